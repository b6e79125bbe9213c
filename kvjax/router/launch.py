"""Running the router front: `serve_router` (the `kvjax router` command, blocking until SIGINT /
SIGTERM) and `RouterThread` (in-process on 127.0.0.1 and a free port, for tests)."""
from __future__ import annotations

import socket
import threading
import time

from kvjax.router.app import RouterConfig, build_router_app
from kvjax.server.protocol import MAX_HEADER_BYTES

# h11 buffers at most this much of an incomplete request head (more: a plain 400, connection
# closed); twice the app's limit, so a head between the two always gets the app's 431
H11_MAX_HEAD_BYTES = 2 * MAX_HEADER_BYTES


def _server(app, host: str, port: int, log_level: str):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                         access_log=False, timeout_graceful_shutdown=10, http="h11",
                                         h11_max_incomplete_event_size=H11_MAX_HEAD_BYTES))


def serve_router(config: RouterConfig, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    _server(build_router_app(config), host, port, log_level).run()


class RouterThread:
    """`with RouterThread(config) as r: ... r.url ...`: a router running in this process."""

    def __init__(self, config: RouterConfig, *, log_level: str = "warning", start_timeout: float = 30.0) -> None:
        self.app = build_router_app(config)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = _server(self.app, "127.0.0.1", self.port, log_level)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, name="kvjax-router",
                                        daemon=True)
        self._start_timeout = start_timeout

    @property
    def router(self):
        return self.app.state.router

    @property
    def replicas(self):
        return self.app.state.replicas

    def start(self) -> RouterThread:
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the router did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(5)

    def __enter__(self) -> RouterThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
