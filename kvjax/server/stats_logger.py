"""What `kvjax serve` tells its operator: the startup banner, one line per request (debug level)
and a periodic stats line shaped like vLLM's:

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.0 tokens/s, Running: 4 reqs,
    Waiting: 0 reqs, GPU KV cache usage: 12.5%, Prefix cache hit rate: 61.0%

The engine thread calls `StatsLogger` (it reads the core's counters and the ledger, which only
that thread may touch); lines go to the `kvjax.server.stats` logger, so `--log-level` and the
usual `logging` configuration decide what is shown.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Hashable

from kvjax.device.buckets import bucket

log = logging.getLogger("kvjax.server.stats")


def _powers(lo: int, hi: int) -> list[int]:
    """Powers of two from bucket(lo) to bucket(hi) (at least one)."""
    out, b = [], bucket(lo)
    while True:
        out.append(b)
        if b >= bucket(max(hi, lo)):
            return out
        b *= 2


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}..{values[-1]}"


def compile_buckets(engine_config, cache_config) -> tuple[str, int]:
    """(description, number) of the step shapes the engine's one forward per step may compile,
    each on first use: decode rows [Bd, 1] with prefill rows [Bp, T] (either group may be
    absent; Bp * T within the token budget), one block-table width
    (`kvjax.engine.batching.forward_shapes`)."""
    from kvjax.engine.batching import forward_shapes, table_width

    b = engine_config.buckets
    s = engine_config.scheduler
    decode = _powers(b.min_batch, s.max_batch_size)
    rows = _powers(1, min(b.prefill_rows, s.max_batch_size))
    chunks = _powers(b.min_chunk, s.max_num_tokens)
    count = len(forward_shapes(engine_config, cache_config))
    text = (f"decode rows 0 or {_span(decode)} x 1 token with prefill rows 0 or {_span(rows)} x chunk "
            f"{_span(chunks)} tokens (rows x chunk <= {bucket(s.max_num_tokens, b.min_chunk)}), block tables "
            f"{table_width(cache_config)} wide: at most {count} programs, each compiled before serving (--warmup) "
            f"or on first use")
    return text, count


def log_startup(engine, *, model_name: str, model_arg: str, sizing: str | None = None, mesh_size: int = 1,
                logger: logging.Logger | None = None) -> None:
    """The startup banner: model, dtype, parameters, cache per tier, limits, buckets to compile."""
    lg = logger or logging.getLogger("kvjax.server")
    model = engine.engine.model
    spec = model.spec
    cc = engine.core.cache_config
    cfg = engine.core.cfg
    tpb = cc.tokens_per_block
    dtype = getattr(getattr(model, "dtype", None), "name", None) or spec.dtype
    lg.info("model %r (%s): %s, %s parameters, %d layers, dtype %s, tensor parallel %d", model_name, model_arg,
            spec.name, f"{getattr(spec, 'num_parameters', '?'):,}" if hasattr(spec, "num_parameters") else "?",
            spec.num_layers, dtype, mesh_size)  # (a hybrid model's spec does not count its parameters)
    for w in cc.windows:
        p, s = cc.primary_blocks_for(w), cc.secondary_blocks_for(w)
        lg.info("KV cache (window %d, %s): primary %d blocks = %d tokens, secondary (host) %d blocks = %d tokens, "
                "%d tokens per block", w, cc.dtype, p, p * tpb, s, s * tpb, tpb)
    if sizing:
        lg.info("KV cache sized from memory: %s", sizing)
    lg.info("max model len %d, max num seqs %d, max num batched tokens %d, prefix caching %s", cc.max_seq_len,
            cfg.scheduler.max_batch_size, cfg.scheduler.max_num_tokens, "on" if cc.enable_block_reuse else "off")
    text, _ = compile_buckets(cfg, cc)
    lg.info("shapes to compile: %s (the first request of each shape waits for its compilation)", text)


@dataclasses.dataclass
class _Request:
    arrival: float
    prompt_tokens: int
    max_tokens: int
    first_token: float | None = None


class StatsLogger:
    """Per-request lines (debug, unless `log_requests` is False) and a stats line every
    `interval` seconds (None: never) while the server has work or had some since the last line."""

    def __init__(self, *, interval: float | None = 10.0, log_requests: bool = True,
                 logger: logging.Logger | None = None) -> None:
        if interval is not None and not interval > 0:
            raise ValueError(f"the stats interval must be > 0 seconds, got {interval}")
        self.interval = interval
        self.log_requests = log_requests
        self.log = logger or log
        self._requests: dict[Hashable, _Request] = {}
        self._last_time: float | None = None
        self._last_counts = (0, 0)
        self._last_active = False

    # ------------------------------------------------------------------ requests
    def request_added(self, request_id: Hashable, prompt_tokens: int, max_tokens: int, arrival: float) -> None:
        if self.log_requests:
            self._requests[request_id] = _Request(arrival, prompt_tokens, max_tokens)

    def request_output(self, out, now: float) -> None:
        r = self._requests.get(out.request_id)
        if r is None:
            return
        n = len(out.outputs[0].token_ids)
        if r.first_token is None and n:
            r.first_token = now
        if out.finished:
            del self._requests[out.request_id]
            ttft = "-" if r.first_token is None else f"{r.first_token - r.arrival:.3f} s"
            self.log.debug("request %s: %d prompt tokens, max_tokens %d, finished (%s) with %d tokens, TTFT %s, "
                           "e2e %.3f s", out.request_id, r.prompt_tokens, r.max_tokens,
                           out.outputs[0].finish_reason, n, ttft, now - r.arrival)

    # ------------------------------------------------------------------ periodic
    def step(self, core, now: float) -> str | None:
        """Called by the engine thread after each iteration; logs (and returns) the stats line
        when one is due."""
        if self.interval is None:
            return None
        c = core.counters
        counts = (c.computed_prompt_tokens, c.generated_tokens)
        if self._last_time is None:  # the first call starts the clock; the counts count from zero (a
            self._last_time = now  # request served before this call is in the first line, not lost)
            return None
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return None
        prompt, generated = (a - b for a, b in zip(counts, self._last_counts, strict=True))
        active = bool(prompt or generated or core.num_running or core.num_waiting)
        self._last_time, self._last_counts = now, counts
        if not active and not self._last_active:
            return None  # idle, and the last line already said so
        self._last_active = active
        line = self.format(core, prompt / elapsed, generated / elapsed)
        self.log.info("%s", line)
        return line

    @staticmethod
    def format(core, prompt_tps: float, generation_tps: float) -> str:
        st = core.ledger.stats()
        total = st.used_num_blocks + st.free_num_blocks
        usage = st.used_num_blocks / total if total else 0.0
        c = core.counters
        hit = c.reused_prompt_tokens / c.admitted_prompt_tokens if c.admitted_prompt_tokens else 0.0
        line = (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: {generation_tps:.1f} "
                f"tokens/s, Running: {core.num_running} reqs, Waiting: {core.num_waiting} reqs, "
                f"GPU KV cache usage: {usage:.1%}, Prefix cache hit rate: {hit:.1%}")
        if st.max_secondary_blocks:
            used = st.max_secondary_blocks - st.free_secondary_blocks
            line += f", Host KV cache usage: {used / st.max_secondary_blocks:.1%}"
        return line
