"""The operator's log lines: the periodic stats line (vLLM's shape, from the core's counters and
the ledger), its idle rule, one debug line per finished request, and the shapes to compile."""
import logging
import types

import pytest

from kvjax.engine.config import EngineConfig, cache_config
from kvjax.engine.outputs import CompletionOutput, RequestOutput
from kvjax.model_catalog import load_model_spec
from kvjax.server.stats_logger import StatsLogger, compile_buckets


class FakeCore:
    def __init__(self):
        self.counters = types.SimpleNamespace(computed_prompt_tokens=0, generated_tokens=0, reused_prompt_tokens=0,
                                              admitted_prompt_tokens=0)
        self.num_running = self.num_waiting = 0
        self.used, self.free, self.secondary, self.secondary_free = 0, 100, 0, 0
        self.ledger = self

    def stats(self):
        return types.SimpleNamespace(used_num_blocks=self.used, free_num_blocks=self.free,
                                     max_secondary_blocks=self.secondary, free_secondary_blocks=self.secondary_free)


def test_stats_line_every_interval_while_active(caplog):
    caplog.set_level(logging.INFO, logger="kvjax.server.stats")
    core = FakeCore()
    stats = StatsLogger(interval=10.0)
    assert stats.step(core, 100.0) is None  # the first call starts the clock
    c = core.counters
    c.computed_prompt_tokens, c.generated_tokens = 500, 40
    c.admitted_prompt_tokens, c.reused_prompt_tokens = 800, 300
    core.num_running, core.num_waiting, core.used = 3, 2, 25
    assert stats.step(core, 105.0) is None  # not due yet
    line = stats.step(core, 110.0)
    assert line == ("Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 4.0 tokens/s, Running: 3 reqs, "
                    "Waiting: 2 reqs, GPU KV cache usage: 20.0%, Prefix cache hit rate: 37.5%")
    assert [r.getMessage() for r in caplog.records] == [line]
    # work finished in the next interval: one more line, then silence while idle
    core.num_running = core.num_waiting = 0
    c.generated_tokens = 60
    assert stats.step(core, 120.0).startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 2.0")
    idle = stats.step(core, 130.0)
    assert idle is not None and "Running: 0 reqs" in idle  # the line that says it went idle
    assert stats.step(core, 140.0) is None and stats.step(core, 150.0) is None
    core.secondary, core.secondary_free, core.num_waiting = 40, 30, 1
    assert stats.step(core, 160.0).endswith("Host KV cache usage: 25.0%")
    assert StatsLogger(interval=None).step(core, 1e9) is None
    with pytest.raises(ValueError, match="> 0"):
        StatsLogger(interval=0)


def test_work_done_before_the_first_call_is_in_the_first_line():
    """A request served before the logger's first call (the engine thread steps it first) still
    counts: the counts start from zero, not from the first call's."""
    core = FakeCore()
    c = core.counters
    c.computed_prompt_tokens, c.generated_tokens = 30, 10  # one request, prefilled and finished
    stats = StatsLogger(interval=1.0)
    assert stats.step(core, 50.0) is None  # starts the clock
    line = stats.step(core, 51.0)
    assert line is not None and line.startswith("Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: 10.0")
    assert stats.step(core, 52.0) is not None  # the line that says it went idle
    assert stats.step(core, 53.0) is None


def _out(rid, n, finished, reason=None):
    return RequestOutput(rid, None, [1, 2, 3], [CompletionOutput(0, "", list(range(n)), reason)], finished)


def test_request_lines_at_debug(caplog):
    caplog.set_level(logging.DEBUG, logger="kvjax.server.stats")
    stats = StatsLogger(interval=None)
    stats.request_added("r1", 3, 16, arrival=10.0)
    stats.request_output(_out("r1", 0, False), 10.5)
    stats.request_output(_out("r1", 1, False), 11.25)
    stats.request_output(_out("r1", 16, True, "length"), 12.0)
    stats.request_added("r2", 3, 4, arrival=20.0)
    stats.request_output(_out("r2", 0, True, "abort"), 20.5)
    assert [r.getMessage() for r in caplog.records] == [
        "request r1: 3 prompt tokens, max_tokens 16, finished (length) with 16 tokens, TTFT 1.250 s, e2e 2.000 s",
        "request r2: 3 prompt tokens, max_tokens 4, finished (abort) with 0 tokens, TTFT -, e2e 0.500 s",
    ]
    assert all(r.levelno == logging.DEBUG for r in caplog.records)
    quiet = StatsLogger(interval=None, log_requests=False)  # --disable-log-requests
    caplog.clear()
    quiet.request_added("r3", 3, 4, arrival=0.0)
    quiet.request_output(_out("r3", 4, True, "length"), 1.0)
    assert caplog.records == []


def test_compile_buckets():
    spec = load_model_spec("micro")
    cfg = EngineConfig.from_dict({"max_batch_size": 8, "max_num_tokens": 256, "min_batch_bucket": 2,
                                  "min_chunk_bucket": 64, "min_blocks_bucket": 8, "prefill_rows": 2})
    cc = cache_config(spec, {"tokens_per_block": 16, "max_seq_len": 512}, max_num_tokens=256)
    text, count = compile_buckets(cfg, cc)
    # one forward per step: decode rows 0, 2, 4, 8 with prefill rows 0 or 1 x chunk 64, 128, 256 or 2 x
    # chunk 64, 128 (rows x chunk <= 256), but not both absent; one table width (512 / 16 = 32)
    assert count == 4 * (1 + 3 + 2) - 1 == 23
    assert text.startswith("decode rows 0 or 2..8 x 1 token with prefill rows 0 or 1..2 x chunk 64..256 tokens "
                           "(rows x chunk <= 256), block tables 32 wide: at most 23 programs")
