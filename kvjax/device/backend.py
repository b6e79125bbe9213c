"""Which implementation an op runs: `impl="auto" | "xla" | "pallas"`.

"pallas" means the Mosaic GPU kernels (`plgpu.kernel`, TMA) on a GPU and the portable
`pl.pallas_call` kernels under `interpret=True` elsewhere (CPU tests).

"auto":
  CPU: XLA for everything. The Pallas interpreter is a test vehicle (~3x slower than XLA's own
       gather), and XLA's donated gather/scatter already streams at its full rate.
  GPU: XLA for gather_kv, write_kv and apply_transfers: they are pure data movement that
       XLA's gather/scatter fusions run at memory bandwidth, and that path is verified.
       Pallas for paged_attention with 16-bit K/V: the XLA path must materialise the gathered
       K/V (read pool, write copy, read copy: ~3x the bytes), the kernel reads each page once
       straight from the pool. float32 stays on XLA (the kernel's tensor-core dot would be
       TF32, the contract is full float32 precision), and so do shapes the kernel does not
       take (head_dim not a multiple of 64, pages under 8 tokens).
Override globally with the environment variable `KVJAX_IMPL=xla|pallas`.
"""
from __future__ import annotations

import os

import jax

IMPLS = ("auto", "xla", "pallas")


def platform() -> str:
    return jax.default_backend()


def on_gpu() -> bool:
    return platform() == "gpu"


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"{impl=} must be one of {IMPLS}")


def resolve(impl: str, op: str, *, dtype=None, head_dim: int | None = None, tokens_per_block: int | None = None) -> str:
    """Concrete implementation ("xla" or "pallas") for `op` on the current backend."""
    check_impl(impl)
    if impl != "auto":
        return impl
    env = os.environ.get("KVJAX_IMPL")
    if env in ("xla", "pallas"):
        return env
    if on_gpu() and op == "paged_attention" and dtype is not None:
        from pallas_kernels.paged_attention import mgpu_supported

        if mgpu_supported(dtype, head_dim, tokens_per_block):
            return "pallas"
    return "xla"
