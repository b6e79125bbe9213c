"""Pallas kernels for kvjax's paged KV pools.

Each module holds two formulations of one kernel:
  *_mgpu      Mosaic GPU (`plgpu.kernel`; TMA copies driven by a scalar load of the block
              table or index list). The GPU path. On CPU it runs under
              `plgpu.InterpretGPUParams(detect_races=True)` (tests, tens of blocks) and is
              cross-lowered for an abstract "NVIDIA H200" in the test suite.
  *_portable  `pl.pallas_call` with whole-array refs indexed inside the body, which runs
              well under `interpret=True` on CPU (the Triton GPU backend is deprecated: it is
              never used on GPU).
and a dispatcher that picks Mosaic GPU on a GPU and the portable kernel elsewhere.
Pool arrays are the 6-D arrays of `kvjax.device.pools` (block_first or layer_first).
"""
