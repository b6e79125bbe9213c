"""Helpers of the hybrid model tests: the committed fixtures (tests/fixtures/hf_hybrid, written by
tests/fixtures/make_hybrid_fixtures_lfm2_granite.py with transformers 5.24) and the comparisons."""
import json
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkpoint tests' helpers (tests/models)
from hf_helpers import read_all as read_tensors  # noqa: E402  (re-exported: the hybrid tests rewrite checkpoints too)
from hf_helpers import write_safetensors  # noqa: E402

from kvjax.hf_config import UnknownConfigFieldWarning, UnsupportedConfigError  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "hf_hybrid"
__all__ = ["FIXTURES", "read_tensors", "write_safetensors"]


def expected(family: str) -> dict:
    return json.loads((FIXTURES / family / "expected.json").read_text())


def logit_error(model, family: str) -> float:
    """Largest |logit difference| to transformers over every stored position of every prompt:
    all prompts in one right-padded batch through a jitted dense_forward (causal: the padding
    after a prompt never reaches its positions)."""
    exp = expected(family)
    width = max(len(p) for p in exp["prompts"])
    batch = np.zeros((len(exp["prompts"]), width), np.int32)
    for row, prompt in enumerate(exp["prompts"]):
        batch[row, :len(prompt)] = prompt
    graphdef, params = nnx.split(model)
    logits = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p).dense_forward(t))(params, jnp.asarray(batch)))
    worst = 0.0
    for row, ref in enumerate(exp["logits"]):
        got = logits[row, ref["positions"]]  # [P, V]
        worst = max(worst, float(np.abs(got - np.asarray(ref["values"], np.float32)).max()))
    return worst


def greedy_chunked(model, step, prompt: list[int], new_tokens: int, chunk: int, max_len: int = 64) -> list[int]:
    """Greedy continuation through `step` (`jit_forward_chunk(model)`): the prompt in chunks of
    `chunk` tokens, its remainder token by token, then decode steps (two compiled shapes in all)."""
    state = model.init_state(1, max_len)
    whole = len(prompt) // chunk * chunk
    pieces = [prompt[i:i + chunk] for i in range(0, whole, chunk)] + [[t] for t in prompt[whole:]]
    for piece in pieces:
        logits, state = step(jnp.asarray([piece], jnp.int32), state)
    out = []
    for i in range(new_tokens):
        tok = int(jnp.argmax(logits[0, -1]))
        out.append(tok)
        if i + 1 < new_tokens:
            logits, state = step(jnp.asarray([[tok]], jnp.int32), state)
    return out


def perturb(model, names: tuple[str, ...], seed: int = 7) -> None:
    """Move the named parameters (biases, norm scales) away from 0 / 1 so a dropped term shows
    (numpy draws: no JAX compilation per parameter shape)."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] in names:
            value = np.asarray(var.get_value())
            var.set_value(jnp.asarray(value + 0.5 * rng.standard_normal(value.shape), value.dtype))


def fixture_config(family: str, **changes) -> dict:
    """A fixture's config.json with `changes` (a value of `...` removes the field)."""
    base = json.loads((FIXTURES / family / "config.json").read_text())
    base.update(changes)
    return {k: v for k, v in base.items() if v is not ...}


def assert_greedy_matches(model, family: str) -> None:
    """transformers' greedy continuations through `jit_forward_chunk`: prompts prefilled in chunks of 8."""
    from kvjax.models.hybrid import jit_forward_chunk

    exp = expected(family)
    step = jit_forward_chunk(model)
    for i, (prompt, want) in enumerate(zip(exp["prompts"], exp["greedy"], strict=True)):
        assert greedy_chunked(model, step, prompt, len(want), chunk=8) == want, f"{family} prompt {i}"


def chunk_forward(variant, graphdef):
    """`forward_chunk(params, tokens, state)` of the split model, under a chex variant (jit or not)."""
    return variant(lambda params, toks, state: nnx.merge(graphdef, params).forward_chunk(toks, state))


def assert_chunks_match_dense(model, fwd, params, tokens, dense, splits, max_len: int):
    """Chunks of `splits` sizes, then the rest token by token (decode), give the `dense` logits; the final state."""
    b, s = tokens.shape
    state = model.init_state(b, max_len)
    outs, pos = [], 0
    for size in list(splits) + [1] * (s - sum(splits)):
        logits, state = fwd(params, tokens[:, pos:pos + size], state)
        chex.assert_shape(logits, (b, size, model.spec.vocab_size))
        outs.append(logits)
        pos += size
    chex.assert_trees_all_close(jnp.concatenate(outs, axis=1), dense, atol=3e-5, rtol=1e-5)
    assert int(state.length) == s
    return state


def assert_decode_compiles_once(model, steps: int) -> None:
    """`steps` single-token decode steps of a jitted forward_chunk trace it once."""
    graphdef, params = nnx.split(model)
    chex.clear_trace_counter()  # the counter keys on source and call stack: every family's test shares both

    @jax.jit
    @chex.assert_max_traces(n=1)
    def decode(params, tok, state):
        return nnx.merge(graphdef, params).forward_chunk(tok, state)

    state = model.init_state(1, 12)
    for t in range(steps):
        _, state = decode(params, jnp.asarray([[t + 3]], jnp.int32), state)
    assert int(state.length) == steps


def assert_unknown_fields_warn_or_refuse(read_spec, config: dict) -> None:
    """An unknown field is named in a warning, and refused with strict=True."""
    with pytest.warns(UnknownConfigFieldWarning, match="'mystery'"):
        read_spec(dict(config, mystery=3))
    with pytest.raises(UnsupportedConfigError, match="'mystery'"):
        read_spec(dict(config, mystery=3), strict=True)
