"""The OpenAI-compatible HTTP server (`kvjax serve`): `build_app` (Starlette routes, `app.py`;
handlers in `completion_routes.py` and `service_routes.py`), the engine thread
(`engine_loop.py`), request checking (`protocol.py`), Prometheus metrics (`metrics.py`), and
`serve` / `ServerThread` to run it (`launch.py`).

Names load on first use, so `kvjax.server.protocol` (which the router front shares to read
requests exactly as a replica does) does not import the engine or JAX."""
_NAMES = {
    "EngineLoop": "kvjax.server.engine_loop",
    "QueueFull": "kvjax.server.engine_loop",
    "ShuttingDown": "kvjax.server.engine_loop",
    "ServerConfig": "kvjax.server.config",
    "build_app": "kvjax.server.app",
    "ServerThread": "kvjax.server.launch",
    "serve": "kvjax.server.launch",
}


def __getattr__(name: str):
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'kvjax.server' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = sorted(_NAMES)
