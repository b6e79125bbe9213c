"""Checked mode: report bad *traced* inputs with `jax.experimental.checkify`.

Concrete (numpy) inputs are always validated on the host with a clear `ValueError`. Values
known only on the device (jax arrays, or tracers inside a user's `jax.jit` / `lax.scan`)
cannot be checked that way; they are made harmless instead (slots in the null block or out
of range are never written, table entries out of range read the zero null slot, a layer
outside its pool reads zeros and writes nothing). Checked mode also reports them:

    with kvjax.device.checked():
        pools = write_kv(pools, layer, k, v, slots)          # eager: raises ValueError
        err, out = checkify.checkify(step)(pools, ...)        # inside your jit: functionalise
        err.throw()

Called eagerly, an op validates its device inputs in a separate jitted check *before* it
donates anything, so a failure leaves the pools usable. Called while tracing, the op adds
`checkify.check`s to the caller's computation, which must then be wrapped in
`checkify.checkify` (JAX refuses to trace an unfunctionalised check). The mode is read when
an op is traced: a step compiled outside it has no checks.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
from jax.experimental import checkify

_CHECKED = contextvars.ContextVar("kvjax_device_checked", default=False)


@contextlib.contextmanager
def checked(enabled: bool = True):
    """Turn checked mode on (or off) for the ops called or traced inside the block."""
    token = _CHECKED.set(bool(enabled))
    try:
        yield
    finally:
        _CHECKED.reset(token)


def is_checked() -> bool:
    return _CHECKED.get()


def check(pred, message: str, *fmt_args) -> None:
    """A `checkify.check` (only ever called from code traced with checks enabled)."""
    checkify.check(pred, message, *fmt_args)


@functools.lru_cache(maxsize=None)
def _checked_jit(validator, static: tuple):
    return jax.jit(checkify.checkify(functools.partial(validator, **dict(static))))


def run_eager_checks(validator, *args, **static) -> None:
    """Run `validator(*args, **static)` (which calls `check`) as its own checkified jit (one
    compilation per static set) and raise its first failure as `checkify.JaxRuntimeError`
    (a `ValueError`)."""
    err, _ = _checked_jit(validator, tuple(sorted(static.items())))(*args)
    err.throw()
