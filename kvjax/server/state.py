"""`ServerState`: what every handler of one server shares (the engine thread, metrics,
configuration, tokenizer, the cache's limits, identity), built once by `build_app` and handed to
the handler modules, so that they are plain functions rather than closures."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

from kvjax.engine.llm_engine import LLMEngine
from kvjax.server.config import ServerConfig
from kvjax.server.engine_loop import EngineLoop
from kvjax.server.metrics import ServerMetrics
from kvjax.server.stats_logger import StatsLogger


class ServerState:
    """One server's shared state. `running_loop` is the event loop serving it (set when the
    lifespan starts: the engine thread's death is reported on it); `started` and `instance_id`
    identify this run (a restarted server is a new instance: its cache starts empty)."""

    def __init__(self, engine: LLMEngine, config: ServerConfig, on_death: Callable[[BaseException], None]) -> None:
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics(config.model_name)
        stats = StatsLogger(interval=config.log_stats_interval, log_requests=config.log_requests)
        self.engine_loop = EngineLoop(engine, max_pending=config.max_pending, metrics=self.metrics, stats=stats,
                                      on_death=on_death)
        self.running_loop: asyncio.AbstractEventLoop | None = None
        self.tokenizer = engine.tokenizer
        self.max_seq_len = engine.max_seq_len
        tokenizer = self.tokenizer
        self.chars_per_token = None if tokenizer is None else tokenizer.max_chars_per_token()
        self.cache_config = engine.core.cache_config
        self.tokenizer_info = None if tokenizer is None else {
            "source": config.tokenizer_source, "fingerprint": tokenizer.fingerprint(), "vocab_size": tokenizer.vocab_size}
        self.started = int(time.time())
        self.instance_id = uuid.uuid4().hex

    @property
    def serving(self) -> bool:
        """The engine thread runs and takes requests (not draining)."""
        return self.engine_loop.alive and self.engine_loop.accepting
