"""Where the built-in model and workload files live, installed or in a source checkout.

A wheel carries `configs/` as the package `kvjax.configs` (pyproject maps the directory);
an editable install or a plain checkout reads the top-level `configs/` directly.
"""
from __future__ import annotations

from pathlib import Path


def configs_dir() -> Path:
    """The directory holding `models/` and `workloads/`."""
    installed = Path(__file__).resolve().parent / "configs"
    if (installed / "models").is_dir():
        return installed
    return Path(__file__).resolve().parent.parent / "configs"
