"""The OpenAI-compatible HTTP server (`kvjax serve`): `build_app` (Starlette routes, `app.py`),
the engine thread (`engine_loop.py`), request checking (`protocol.py`), Prometheus metrics
(`metrics.py`), and `serve` / `ServerThread` to run it (`launch.py`)."""
from kvjax.server.app import ServerConfig, build_app
from kvjax.server.engine_loop import EngineLoop, QueueFull, ShuttingDown
from kvjax.server.launch import ServerThread, serve

__all__ = ["EngineLoop", "QueueFull", "ServerConfig", "ServerThread", "ShuttingDown", "build_app", "serve"]
