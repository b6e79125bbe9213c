"""`load_store(url)`: a store from one string, for a command-line flag or a config file.

    memory://?max_bytes=2GiB
    file:///var/cache/kvjax?max_bytes=100GiB&fsync=1
    redis://127.0.0.1:6379/0?ttl_s=3600&prefix=kvjax:      (also rediss:// and unix://)
    my_package.stores:MyStore?endpoint=10.0.0.5&shards=4      (a user class, kwargs as strings)

Every error is a `StoreURLError` naming the URL and the problem; nothing is opened before the
whole URL has been checked.
"""
from __future__ import annotations

import importlib
import re
import urllib.parse
from typing import Any

from kvjax.kv_store.errors import StoreURLError
from kvjax.kv_store.interface import KVStore
from kvjax.kv_store.sizes import parse_bytes

_MODULE_SPEC = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*):([A-Za-z_][A-Za-z0-9_]*)")
_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def _params(url: str, query: str) -> dict[str, str]:
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as e:
        raise StoreURLError(f"store URL {url!r}: malformed query string: {e}") from None
    out: dict[str, str] = {}
    for k, v in pairs:
        if k in out:
            raise StoreURLError(f"store URL {url!r}: parameter {k!r} given twice")
        out[k] = v
    return out


def _only(url: str, params: dict[str, str], allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> None:
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise StoreURLError(f"store URL {url!r}: unknown parameter(s) {unknown}; allowed: {list(allowed)}")
    missing = [k for k in required if k not in params]
    if missing:
        raise StoreURLError(f"store URL {url!r}: missing parameter(s) {missing}")


def _size(url: str, name: str, value: str) -> int:
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise StoreURLError(f"store URL {url!r}: {name}: {e}") from None


def _bool(url: str, name: str, value: str) -> bool:
    b = _BOOLS.get(value.lower())
    if b is None:
        raise StoreURLError(f"store URL {url!r}: {name} must be one of {sorted(_BOOLS)}, got {value!r}")
    return b


def redact(url: str) -> str:
    """The URL with any password replaced by `***`, for error messages and logs."""
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.netloc.rpartition("@")[2]
        return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
    except ValueError:
        return url.split("@")[-1] if "@" in url else url


def load_store(url: str) -> KVStore:
    """Build the store a URL names (see the module docstring for the forms)."""
    if not isinstance(url, str) or not url:
        raise StoreURLError(f"a store URL must be a non-empty str, got {url!r}")
    if "://" not in url:
        return _load_class(url)
    shown = redact(url)
    try:
        return _load_scheme(url, shown)
    except StoreURLError:
        raise
    except ValueError as e:
        raise StoreURLError(f"store URL {shown!r}: {e}") from None


def _load_scheme(url: str, shown: str) -> KVStore:
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    params = _params(shown, parts.query)
    if parts.fragment:
        raise StoreURLError(f"store URL {shown!r}: a fragment ('#...') means nothing here")
    if scheme == "memory":
        _only(shown, params, ("max_bytes",), ("max_bytes",))
        if parts.netloc or parts.path not in ("", "/"):
            raise StoreURLError(f"store URL {shown!r}: memory:// takes no host or path, only ?max_bytes=")
        from kvjax.kv_store.memory import MemoryStore

        return MemoryStore(_size(shown, "max_bytes", params["max_bytes"]))
    if scheme == "file":
        _only(shown, params, ("max_bytes", "fsync"), ("max_bytes",))
        if parts.netloc not in ("", "localhost"):
            raise StoreURLError(
                f"store URL {shown!r}: file:// URLs name a local directory (file:///abs/path), not host {parts.netloc!r}"
            )
        path = urllib.parse.unquote(parts.path)
        if not path.startswith("/") or path == "/":
            raise StoreURLError(f"store URL {shown!r}: file:// needs an absolute directory path other than /")
        from kvjax.kv_store.file import FileStore

        return FileStore(path, _size(shown, "max_bytes", params["max_bytes"]),
                         fsync=_bool(shown, "fsync", params["fsync"]) if "fsync" in params else False)
    if scheme in ("redis", "rediss", "unix"):
        _only(shown, params, ("ttl_s", "prefix", "socket_timeout_s"))
        ttl = params.get("ttl_s")
        if ttl is not None and not (ttl.isdigit() and int(ttl) > 0):
            raise StoreURLError(f"store URL {shown!r}: ttl_s must be a positive whole number of seconds, got {ttl!r}")
        try:
            timeout = float(params.get("socket_timeout_s", "5"))
        except ValueError:
            raise StoreURLError(f"store URL {shown!r}: socket_timeout_s must be a number") from None
        if not timeout > 0:
            raise StoreURLError(f"store URL {shown!r}: socket_timeout_s must be > 0")
        if scheme != "unix" and not parts.hostname:
            raise StoreURLError(f"store URL {shown!r}: a Redis URL needs a host (redis://HOST:PORT/DB)")
        try:
            _ = parts.port
        except ValueError as e:
            raise StoreURLError(f"store URL {shown!r}: {e}") from None
        bare = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
        from kvjax.kv_store.redis_store import RedisStore

        try:
            return RedisStore(bare, prefix=params.get("prefix", ""), ttl_s=int(ttl) if ttl else None, socket_timeout_s=timeout)
        except ValueError as e:
            raise StoreURLError(f"store URL {shown!r}: {e}") from None
    raise StoreURLError(
        f"store URL {shown!r}: unknown scheme {scheme!r}; use memory://, file://, redis://, or module.path:ClassName"
    )


def _load_class(url: str) -> KVStore:
    spec, _, query = url.partition("?")
    m = _MODULE_SPEC.fullmatch(spec)
    if m is None:
        raise StoreURLError(f"store URL {url!r}: expected scheme://... or module.path:ClassName[?k=v&...]")
    params = _params(url, query)
    try:
        module = importlib.import_module(m.group(1))
    except ImportError as e:
        raise StoreURLError(f"store URL {url!r}: cannot import module {m.group(1)!r}: {e}") from e
    cls: Any = getattr(module, m.group(2), None)
    if not isinstance(cls, type):
        raise StoreURLError(f"store URL {url!r}: module {m.group(1)!r} has no class {m.group(2)!r}")
    methods = ("batch_exists", "batch_put", "batch_get_into", "remove", "close")
    missing = [name for name in methods if not callable(getattr(cls, name, None))]
    if missing:
        raise StoreURLError(f"store URL {url!r}: {cls.__qualname__} does not implement the KVStore methods {missing}")
    try:
        store = cls(**params)
    except (TypeError, ValueError) as e:  # unknown or malformed keyword arguments
        raise StoreURLError(f"store URL {url!r}: {cls.__qualname__}({', '.join(params)}) failed: {e}") from e
    return store
