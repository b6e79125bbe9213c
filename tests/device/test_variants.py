"""The ops as a user calls them, eagerly and inside `jax.jit` (chex.variants): the same
results either way, shapes and dtypes as documented; and every public device and kernel
function carries jaxtyping shape annotations on its array arguments."""
import inspect

import chex
import jax.numpy as jnp
import numpy as np
from device_helpers import fill, make_config

import pallas_kernels.copy_pages
import pallas_kernels.gather_pages
import pallas_kernels.paged_attention
import pallas_kernels.write_pages
from kvjax import device
from kvjax.device import (
    allocate_pools,
    gather_kv,
    gather_kv_reference,
    paged_attention,
    paged_attention_reference,
    quant,
    write_kv,
    write_kv_reference,
)


class OpsVariants(chex.TestCase):
    def setUp(self):
        super().setUp()
        self.cfg = make_config(num_layers=2, attention_windows=None, primary_blocks=8, secondary_blocks=0, head_dim=8)
        self.rng = np.random.default_rng(0)
        self.table = jnp.asarray(self.rng.permutation(8)[:6].reshape(2, 3), jnp.int32)
        self.lens = jnp.array([12, 7], jnp.int32)

    @chex.variants(with_jit=True, without_jit=True)
    def test_write_then_gather(self):
        pools = fill(allocate_pools(self.cfg), seed=1)
        k = jnp.asarray(self.rng.standard_normal((5, 2, 8)), jnp.float32)
        sm = jnp.array([0, 5, 17, -1, 30], jnp.int32)
        want = write_kv_reference(pools, 1, k, -k, sm)
        want_kv = gather_kv_reference(want, 1, self.table, self.lens)
        write = self.variant(lambda p, k, s, layer: write_kv(p, layer, k, -k, s))
        pools = write(pools, k, sm, jnp.int32(1))  # a traced (or device-array) layer: one pool, no pool= needed
        chex.assert_trees_all_equal(pools.primary, want.primary)
        kv = self.variant(lambda p, t, s: gather_kv(p, 1, t, s))(pools, self.table, self.lens)
        chex.assert_shape(kv, [(2, 12, 2, 8), (2, 12, 2, 8)])
        chex.assert_trees_all_equal(kv, want_kv)

    @chex.variants(with_jit=True, without_jit=True)
    def test_attention(self):
        pools = fill(allocate_pools(self.cfg), seed=2)
        q = jnp.asarray(self.rng.standard_normal((2, 3, 4, 8)), jnp.float32)
        out = self.variant(lambda q, p, t, s: paged_attention(q, p, 0, t, s, scale=0.3))(q, pools, self.table, self.lens)
        chex.assert_shape(out, q.shape)
        chex.assert_type(out, jnp.float32)
        chex.assert_trees_all_close(out, paged_attention_reference(q, pools, 0, self.table, self.lens, scale=0.3),
                                    atol=2e-5, rtol=2e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_fp8_roundtrip(self):
        cfg = make_config(num_layers=1, attention_windows=None, primary_blocks=4, secondary_blocks=0, head_dim=8,
                          dtype="float8_e4m3fn")
        x = jnp.asarray(self.rng.standard_normal((8, 2, 8)), jnp.float32)
        sm = jnp.arange(8, dtype=jnp.int32)
        pools = self.variant(lambda p, x, s: write_kv(p, 0, x, x, s))(allocate_pools(cfg), x, sm)
        k, _ = self.variant(lambda p: gather_kv(p, 0, jnp.array([[0, 1]], jnp.int32), jnp.array([8]), dtype=jnp.float32))(pools)
        chex.assert_trees_all_close(k[0], x, rtol=2.0**-4, atol=0.1 * 2.0**-9)


ARRAY_PARAMS = {"q", "k", "v", "block_table", "seq_lens", "slot_mapping", "pool", "kv", "slot", "off", "layer",
                "scales", "idx", "staging", "dst", "num_tokens", "positions", "write", "mask", "q_positions",
                "k_positions", "x", "y", "pages", "b", "old", "new", "amax", "base", "need"}
JAXTYPING = ("Float[", "Int[", "Shaped[", "Bool[")


def _public_functions():
    mods = [pallas_kernels.copy_pages, pallas_kernels.gather_pages, pallas_kernels.paged_attention,
            pallas_kernels.write_pages, quant]
    fns = [getattr(device, n) for n in device.__all__]
    for m in mods:
        fns += [f for n, f in vars(m).items() if inspect.isfunction(f) and not n.startswith("_") and f.__module__ == m.__name__]
    return [f for f in fns if inspect.isfunction(f)]


def test_public_functions_carry_jaxtyping_shapes():
    checked = 0
    for fn in _public_functions():
        for name, p in inspect.signature(fn).parameters.items():
            ann = str(p.annotation)
            if name in ARRAY_PARAMS and ann not in ("int", "int | None", "PoolSpec"):  # static layer, pool index or spec
                assert any(t in ann for t in JAXTYPING), f"{fn.__module__}.{fn.__name__}({name}) has no jaxtyping shape: {ann}"
                checked += 1
    assert checked > 60
