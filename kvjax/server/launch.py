"""Running the server: `serve` (the `kvjax serve` command, blocking, signals handled by uvicorn)
and `ServerThread` (in-process, for tests and benchmarks: uvicorn in a background thread on a
socket bound before it starts, stopped gracefully).

Graceful shutdown (SIGINT / SIGTERM, or `ServerThread.stop`): the engine first drains
(`EngineLoop.drain`: new requests get 503 and /health turns 503, in-flight ones get
`shutdown_timeout` seconds to finish, the rest are aborted and their responses end normally
with finish reason "abort"); then uvicorn closes the listening socket and the connections, and
the app's lifespan stops the engine thread and checks that the ledger is empty.

If the engine thread dies, the server stops the same way (in-flight requests were already
answered with errors) and `serve` exits with status 1, so that a supervisor restarts it.
Request heads (path, query and headers) over `MAX_HEADER_BYTES` get 431 (`HeaderLimit`)."""
from __future__ import annotations

import logging
import socket
import threading
import time

from kvjax.engine.llm_engine import LLMEngine
from kvjax.server.app import ServerConfig, build_app
from kvjax.server.protocol import MAX_HEADER_BYTES

# h11 buffers at most this much of an incomplete request head (more: a plain 400, connection
# closed); twice the app's limit, so a head between the two always gets the app's 431
H11_MAX_HEAD_BYTES = 2 * MAX_HEADER_BYTES


def _server(app, config: ServerConfig, host: str, port: int, log_level: str):
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            await asyncio.get_running_loop().run_in_executor(None, app.state.engine_loop.drain, config.shutdown_timeout)
            await super().shutdown(sockets)

    # uvicorn's own grace period only matters if a response outlives the drain
    server = Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", access_log=False,
                                   timeout_graceful_shutdown=int(config.shutdown_timeout) + 5, http="h11",
                                   h11_max_incomplete_event_size=H11_MAX_HEAD_BYTES))
    app.state.on_engine_death = lambda: setattr(server, "should_exit", True)
    return server


def serve(engine: LLMEngine, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve until SIGINT / SIGTERM, then shut down gracefully (module docstring); exits with
    status 1 (`SystemExit`) if the engine thread died."""
    app = build_app(engine, config)
    _server(app, config, host, port, log_level).run()
    error = app.state.engine_loop.error
    if error is not None:
        logging.getLogger("kvjax.server").critical("exiting with status 1: the engine thread died (%s: %s)",
                                                   type(error).__name__, error)
        raise SystemExit(1)


class ServerThread:
    """`with ServerThread(engine, config) as srv: ... srv.url ...`: a server on 127.0.0.1 and a
    free port, running in this process until `stop()` (or the end of the `with`)."""

    def __init__(
        self, engine: LLMEngine, config: ServerConfig, *, log_level: str = "warning", start_timeout: float = 30.0
    ) -> None:
        self.app = build_app(engine, config)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = _server(self.app, config, "127.0.0.1", self.port, log_level)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, name="kvjax-http", daemon=True)
        self._start_timeout = start_timeout

    @property
    def engine_loop(self):
        return self.app.state.engine_loop

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(5)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
