"""`ServerConfig`: what `kvjax serve` is told beyond the engine, in a module of its own so the
handler modules and `app.py` share it without importing each other."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """`max_pending`: requests queued or running at once (more get 429);
    `default_max_tokens`: a chat request's limit when it sets none (completions default to 16,
    as OpenAI's API), never beyond the context left; `shutdown_timeout`: seconds in-flight
    requests get to finish at shutdown before they are aborted; `max_body_bytes`: the largest
    request body read (larger ones get 413); `other_model_names`: further names requests may use
    (`model_name` is the one reported); `api_keys`: Bearer keys required on /v1/* (`auth.py`);
    `log_requests` / `log_stats_interval`: `stats_logger.py`."""

    model_name: str
    max_pending: int = 64
    default_max_tokens: int = 256
    shutdown_timeout: float = 10.0
    max_body_bytes: int = 32 << 20
    tokenizer_source: str | None = None  # what a router loads to tokenise alike (model name or directory)
    other_model_names: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()
    log_requests: bool = True
    log_stats_interval: float | None = 10.0
