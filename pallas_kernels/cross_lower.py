"""Lower a function for CUDA against an abstract "NVIDIA H200", on any machine.

Catches unsupported Mosaic GPU features (lowering errors) without a GPU; PTX generation and
ptxas run only when XLA compiles on a real device, so lowering success != runtime success.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def lower_for_h200(fn: Callable[..., Any], *args: Any, donate_argnums: tuple[int, ...] = (), **jit_kwargs: Any) -> str:
    """StableHLO text of `jax.jit(fn)` lowered for CUDA; `args` may be ShapeDtypeStructs."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        lowered = jax.jit(fn, donate_argnums=donate_argnums, **jit_kwargs).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text()
