"""What one step's forward takes besides its rows, and what it gives back per row beside the
tokens: the sampling arrays and `StepExtras` (penalties, bans, logprobs, prompt-scoring targets)
built from the rows' requests, and the sampled tokens' logprobs read back (prompt logprobs are
stored on their requests). Shared by the synchronous step (`EngineCore`) and the overlapped
one (`overlap.OverlappedStepper`): both lay rows out the same way, the `nd` decode-group rows
first, then the prefill rows."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.engine.batching import Buckets, Row, StepExtras, StepOutput
from kvjax.engine.request_state import LiveRequest, TokenLogprobs

if TYPE_CHECKING:
    from kvjax.ledger import KVCacheManager


def forward_inputs(runner: Any, ledger: KVCacheManager, buckets: Buckets, vocab: int, decode: list[Row], prefill: list[Row],
                   reqs: list[LiveRequest], nd: int):
    """The forward's batch, sampling arrays (temperature, top_p, seed, index, top_k), extras
    and which prefill rows score their prompt. A row's index is its token's number in the
    request's key stream, counting tokens still in flight (overlap)."""
    batch = runner.batch(ledger, decode, prefill, buckets)
    sp = [r.item.sampling for r in reqs]
    temperature = np.array([p.temperature for p in sp], np.float32)
    top_p = np.array([p.top_p for p in sp], np.float32)
    top_k = np.array([p.top_k for p in sp], np.int32)
    seed = np.array([r.seed for r in reqs], np.int32)
    index = np.array([len(r.output) + r.in_flight for r in reqs], np.int32)
    scoring = [r.scores_prompt() for r in reqs[nd:]]  # prefill rows that score their prompt
    extras = step_extras(batch, prefill, reqs, nd, any(scoring), vocab)
    return batch, (temperature, top_p, seed, index, top_k), extras, scoring


def row_logprobs(out: StepOutput, prefill: list[Row], reqs: list[LiveRequest], nd: int,
                 scoring: list[bool]) -> list[TokenLogprobs | None]:
    """Per row, the sampled token's logprobs (None unless asked); stores prompt logprobs."""
    toks, results = out.tokens, out.results
    sp = [r.item.sampling for r in reqs]
    lps: list[TokenLogprobs | None] = [None] * len(reqs)
    if "logprobs" in results:
        lp, rank, ids, top = results["logprobs"]
        for i, p in enumerate(sp):
            if p.logprobs is not None:
                lps[i] = TokenLogprobs(int(toks[i]), float(lp[i]), int(rank[i]), tuple(ids[i, : p.logprobs].tolist()),
                                       tuple(top[i, : p.logprobs].tolist()))
    if "prompt_logprobs" in results:
        lp, rank, ids, top = results["prompt_logprobs"]  # [prefill rows, T, ...]
        t = lp.shape[1]
        for j, (r, row) in enumerate(zip(reqs[nd:], prefill, strict=True)):
            if not scoring[j]:
                continue
            assert r.prompt_logprobs is not None  # scores_prompt says it asks for them
            k = r.item.sampling.prompt_logprobs
            for m in range(len(row.tokens)):
                pos = row.start + m + 1  # the prompt token this column's logits predict
                if pos < len(r.prompt):
                    col = t - len(row.tokens) + m
                    r.prompt_logprobs[pos] = TokenLogprobs(r.prompt[pos], float(lp[j, col]), int(rank[j, col]),
                                                           tuple(ids[j, col, :k].tolist()), tuple(top[j, col, :k].tolist()))
    return lps


def step_extras(batch, prefill: list[Row], reqs: list[LiveRequest], nd: int, scores_prompt: bool,
                vocab: int) -> StepExtras | None:
    """What this forward must compute besides the tokens (None: nothing, the plain executable)."""
    banned = [r.banned_ids() for r in reqs]
    penalties = None
    if any(banned) or any(r.item.sampling.penalized for r in reqs):
        v, n = vocab, len(reqs)
        counts = np.zeros((n, v), np.int32)  # [rows, V]
        mask = np.zeros((n, v), bool)  # [rows, V]
        ban = np.zeros((n, v), bool)  # [rows, V]
        for i, r in enumerate(reqs):
            if r.item.sampling.penalized:
                np.add.at(counts[i], np.asarray(r.output, np.int64), 1)
                mask[i] = r.prompt_mask(v)
            if banned[i]:
                ban[i, [t for t in banned[i] if t < v]] = True
        sp = [r.item.sampling for r in reqs]
        penalties = (counts, mask, ban, np.array([p.presence_penalty for p in sp], np.float32),
                     np.array([p.frequency_penalty for p in sp], np.float32),
                     np.array([p.repetition_penalty for p in sp], np.float32))
    logprobs = any(r.item.sampling.logprobs is not None for r in reqs)
    targets = None
    if scores_prompt:  # every prefill row's (only the scoring rows' are read)
        t = batch.shape.chunk
        targets = np.zeros((len(prefill), t), np.int32)  # [prefill rows, T]: the token after each position
        for j, (r, row) in enumerate(zip(reqs[nd:], prefill, strict=True)):
            nxt = r.context[row.start + 1 : row.seq_len + 1]
            targets[j, t - len(row.tokens) : t - len(row.tokens) + len(nxt)] = nxt
    if penalties is None and not logprobs and targets is None:
        return None
    return StepExtras(penalties, logprobs, targets)
