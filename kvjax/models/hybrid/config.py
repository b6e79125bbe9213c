"""Strict reading of a hybrid model's `config.json`: `kvjax.hf_config`'s reader (`ConfigFields`)
with the few checks LFM2 and Granite add.

Every field a family reads is checked (type, range) by `ConfigFields`; the fields nothing read are
sorted there too: known not to change the numbers (`NOT_NUMERIC`, `NOT_NUMERIC_SUFFIXES`, or the
family's own table): ignored; fields of other architectures that would change the numbers
(`UNSUPPORTED_UNLESS`): refused unless harmless; anything else: named in one
`UnknownConfigFieldWarning` (refused with `strict=True`). Pure Python.
"""
from __future__ import annotations

from typing import Any

from kvjax.hf_config import ConfigFields, UnsupportedConfigError, config_dtype, report_unknown_fields


class ConfigReader(ConfigFields):
    """`ConfigFields` for a hybrid family: a null field counts as absent (`has`), legacy copies
    must agree (`same`), unscaled RoPE only (`rope_theta`), and `close` ends the reading."""

    def __init__(self, data: dict, source: str, model_type: str, defaults: dict[str, Any]):
        if not isinstance(data, dict):
            raise UnsupportedConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        super().__init__(data, source, model_type, defaults=defaults)
        self.used.add("model_type")

    def has(self, field: str) -> bool:
        return field in self.data and self.data[field] is not None

    def same(self, field: str, expected: Any, why: str) -> None:
        """A legacy field transformers ignores, accepted only when it agrees with what is computed."""
        self.used.add(field)
        if field in self.data and self.data[field] is not None and self.data[field] != expected:
            raise self.error(field, f"{self.data[field]!r} disagrees with {expected!r} ({why}); refusing an "
                                    "ambiguous config")

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

    def close(self, ignored: dict[str, str], strict: bool) -> str:
        """The config's dtype, after refusing unread fields that would change the numbers and
        warning about (strict: refusing) unknown ones; `ignored`: the family's harmless fields."""
        dtype = config_dtype(self, None)
        report_unknown_fields(self.finish(ignored), self.source, self.model_type, strict)
        return dtype
