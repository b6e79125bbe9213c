"""Strict reading of a hybrid model's `config.json`, with the rules of `kvjax.hf_config`.

Each field a family reads is checked (type, range); fields nothing read are sorted as in
`kvjax.hf_config`: known not to change the numbers (`NOT_NUMERIC`, `NOT_NUMERIC_SUFFIXES`, or the
family's own table): ignored; fields of other architectures that would change the numbers
(`UNSUPPORTED_UNLESS`): refused unless harmless; anything else: named in one
`UnknownConfigFieldWarning` (refused with `strict=True`). Pure Python.
"""
from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path
from typing import Any

from kvjax.hf_config import (
    NOT_NUMERIC,
    NOT_NUMERIC_SUFFIXES,
    UNSUPPORTED_UNLESS,
    UnknownConfigFieldWarning,
    UnsupportedConfigError,
)

log = logging.getLogger("kvjax")
_KVJAX_DIR = str(Path(__file__).parents[2])  # warnings point at the first caller outside kvjax

_DTYPES = ("float32", "bfloat16", "float16")


class ConfigReader:
    """One config being read: typed getters that remember what was read, then `finish`."""

    def __init__(self, data: dict, source: str, model_type: str, defaults: dict[str, Any]):
        if not isinstance(data, dict):
            raise UnsupportedConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        self.data = data
        self.source = source
        self.model_type = model_type
        self.defaults = defaults
        self.used: set[str] = {"model_type"}

    def error(self, field: str, message: str) -> UnsupportedConfigError:
        return UnsupportedConfigError(f"{self.source}: config field {field!r}: {message}")

    def has(self, field: str) -> bool:
        return field in self.data and self.data[field] is not None

    def get(self, field: str, default: Any = ...) -> Any:
        """The field's value; absent or null takes `default`, else transformers' default."""
        self.used.add(field)
        if self.data.get(field) is not None:
            return self.data[field]
        if default is not ...:
            return default
        if field in self.defaults:
            return self.defaults[field]
        raise self.error(field, "missing (and transformers has no default for it)")

    def int(self, field: str, default: Any = ..., *, minimum: int = 1) -> int:
        v = self.get(field, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self.error(field, f"expected an int >= {minimum}, got {v!r}")
        return v

    def number(self, field: str, default: Any = ..., *, positive: bool = True) -> float:
        v = self.get(field, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
            raise self.error(field, f"expected a {'positive ' if positive else ''}finite number, got {v!r}")
        return float(v)

    def flag(self, field: str, default: Any = ...) -> bool:
        v = self.get(field, default)
        if not isinstance(v, bool):
            raise self.error(field, f"expected true or false, got {v!r}")
        return v

    def same(self, field: str, expected: Any, why: str) -> None:
        """A legacy field transformers ignores, accepted only when it agrees with what is computed."""
        self.used.add(field)
        if field in self.data and self.data[field] is not None and self.data[field] != expected:
            raise self.error(field, f"{self.data[field]!r} disagrees with {expected!r} ({why}); refusing an "
                                    "ambiguous config")

    def dtype(self) -> str:
        given = {k: self.get(k, None) for k in ("dtype", "torch_dtype")}
        given = {k: v for k, v in given.items() if v is not None}
        for k, v in given.items():
            if v not in _DTYPES:
                raise self.error(k, f"value {v!r} is not supported (supported: {', '.join(_DTYPES)})")
        if len(set(given.values())) > 1:
            raise self.error("dtype", f"dtype and torch_dtype disagree: {given}")
        return next(iter(given.values()), "float32")

    def rope_theta(self) -> float:
        """The RoPE base of unscaled RoPE (legacy `rope_theta` or `rope_parameters`); scaled RoPE is refused."""
        theta = self.number("rope_theta")
        legacy = self.get("rope_scaling", None)
        if legacy is not None:
            raise self.error("rope_scaling", f"{legacy!r}: scaled RoPE is not supported for model_type "
                                             f"{self.model_type!r} (supported: null)")
        params = self.get("rope_parameters", None)
        if params is None:
            return theta
        if not isinstance(params, dict):
            raise self.error("rope_parameters", f"expected a table, got {params!r}")
        kind = params.get("rope_type", params.get("type", "default"))
        extra = sorted(set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
        if kind != "default" or extra or params.get("partial_rotary_factor", 1.0) != 1.0:
            raise self.error("rope_parameters", f"{params!r}: only unscaled RoPE over the whole head is supported "
                                                "(rope_type default)")
        value = params.get("rope_theta", theta)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise self.error("rope_parameters", f"rope_theta must be a positive number, got {value!r}")
        if self.has("rope_theta") and float(self.data["rope_theta"]) != float(value):
            raise self.error("rope_theta", f"{self.data['rope_theta']} disagrees with rope_parameters' {value}")
        return float(value)

    def finish(self, ignored: dict[str, str], strict: bool) -> None:
        """Refuse unread fields that would change the numbers; warn about (strict: refuse) unknown ones."""
        table = {**NOT_NUMERIC, **ignored}
        unknown = []
        for field in sorted(self.data):
            if field in self.used or field in table or field.endswith(tuple(NOT_NUMERIC_SUFFIXES)):
                continue
            if field in UNSUPPORTED_UNLESS:
                accepted, supported = UNSUPPORTED_UNLESS[field]
                if not accepted(self.data[field]):
                    raise self.error(field, f"value {self.data[field]!r} is not supported for model_type "
                                            f"{self.model_type!r} (supported: {supported})")
                continue
            unknown.append(field)
        if not unknown:
            return
        names = ", ".join(map(repr, unknown))
        if strict:
            raise UnsupportedConfigError(
                f"{self.source}: config field(s) {names}: unknown for model_type {self.model_type!r}; kvjax cannot "
                "tell whether they change the model's numbers, and strict config checking refuses unknown fields"
            )
        message = (f"{self.source}: kvjax ignores config field(s) {names}, unknown for model_type "
                   f"{self.model_type!r}: it cannot tell whether they change the model's numbers; check them, or "
                   "refuse such checkpoints with strict_config=True")
        log.warning("%s", message)
        warnings.warn(message, UnknownConfigFieldWarning, skip_file_prefixes=(_KVJAX_DIR,))
