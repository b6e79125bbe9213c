"""Which implementation an op runs: `impl="auto" | "xla" | "pallas"`.

"pallas" means the Mosaic GPU kernels (`plgpu.kernel`, TMA) on a GPU and the portable
`pl.pallas_call` kernels under `interpret=True` elsewhere (CPU tests).

"auto" (`select`, a pure function of platform, compute capability, dtype and shape):
  CPU: XLA for everything. The Pallas interpreter is a test vehicle (~3x slower than XLA's own
       gather), and XLA's donated gather/scatter already streams at its full rate.
  GPU: XLA for gather_kv, write_kv and apply_transfers: they are pure data movement that
       XLA's gather/scatter fusions run at memory bandwidth, and that path is verified.
       Pallas for paged_attention on Hopper (compute capability 9.x) with 16-bit K/V: the XLA
       path must materialise the gathered K/V (read pool, write copy, read copy: ~3x the
       bytes), the kernel reads each page once straight from the pool. The kernel is built
       on wgmma, which exists only on sm_90a: Ampere and Ada (A100, L40S: 8.x) lack the TMA
       and wgmma it needs, and Blackwell (10.x, 12.x) replaced wgmma, so they all run XLA.
       float32 stays on XLA (the kernel's tensor-core dot would be TF32, the contract is full
       float32 precision), and so do FP8 pools and shapes the kernel does not take (head_dim
       not a multiple of 64, pages under 8 tokens).
An explicit `impl="pallas"` on a GPU that cannot run the kernel raises `ValueError`.
Override "auto" globally with the environment variable `KVJAX_IMPL=xla|pallas` ("pallas"
applies where this device runs the kernel).
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

IMPLS = ("auto", "xla", "pallas")
OPS = ("gather_kv", "write_kv", "paged_attention", "apply_transfers")
#: Mosaic GPU's TMA copies need Hopper or newer.
TMA_MIN_CAPABILITY = (9, 0)
#: The attention kernel's wgmma exists on sm_90a only.
WGMMA_MAJOR = 9


def platform() -> str:
    return jax.default_backend()


def on_gpu() -> bool:
    return platform() == "gpu"


def compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the default device on a CUDA GPU, else None."""
    if not on_gpu():
        return None
    text = getattr(jax.devices()[0], "compute_capability", None)
    return parse_capability(text)


def parse_capability(text) -> tuple[int, int] | None:
    if text is None:
        return None
    parts = str(text).split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return None


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"{impl=} must be one of {IMPLS}")


def kernel_support(op: str, *, platform: str, capability: tuple[int, int] | None, dtype=None,
                   head_dim: int | None = None, tokens_per_block: int | None = None) -> str | None:
    """None if the Pallas kernel of `op` can run here, else why not. Off GPU the portable
    kernels run under the interpreter, which takes everything."""
    if platform != "gpu":
        return None
    if capability is None or capability < TMA_MIN_CAPABILITY:
        return f"Mosaic GPU kernels need compute capability >= 9.0 (Hopper, TMA); this device has {capability}"
    if op == "paged_attention":
        from pallas_kernels.paged_attention import mgpu_supported

        if capability[0] != WGMMA_MAJOR:
            return f"the Mosaic GPU attention kernel uses wgmma (sm_90a, compute capability 9.x); this device has {capability}"
        if dtype is not None and not mgpu_supported(dtype, head_dim, tokens_per_block):
            return (f"the Mosaic GPU attention kernel takes 16-bit K/V, head_dim % 64 == 0 and pages of >= 8 tokens; "
                    f"got dtype={jnp.dtype(dtype).name}, head_dim={head_dim}, tokens_per_block={tokens_per_block}")
    return None


def select(op: str, *, platform: str, capability: tuple[int, int] | None, dtype=None, head_dim: int | None = None,
           tokens_per_block: int | None = None) -> str:
    """What `impl="auto"` runs (see the module docstring): a pure function, testable anywhere."""
    if op not in OPS:
        raise ValueError(f"{op=} must be one of {OPS}")
    if platform == "gpu" and op == "paged_attention" and kernel_support(
            op, platform=platform, capability=capability, dtype=dtype, head_dim=head_dim,
            tokens_per_block=tokens_per_block) is None:
        return "pallas"
    return "xla"


def resolve(impl: str, op: str, *, dtype=None, head_dim: int | None = None, tokens_per_block: int | None = None) -> str:
    """Concrete implementation ("xla" or "pallas") for `op` on the current backend."""
    check_impl(impl)
    plat, cap = platform(), compute_capability()
    support = dict(platform=plat, capability=cap, dtype=dtype, head_dim=head_dim, tokens_per_block=tokens_per_block)
    if impl == "auto":
        env = os.environ.get("KVJAX_IMPL")
        if env == "xla" or (env == "pallas" and kernel_support(op, **support) is None):
            return env
        return select(op, **support)
    if impl == "pallas":
        why = kernel_support(op, **support)
        if why is not None:
            raise ValueError(f"impl='pallas' for {op}: {why}; use impl='xla' (or 'auto')")
    return impl
