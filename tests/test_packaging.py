"""Packaging: the built-in model and workload files ship inside the wheel (as `kvjax.configs`),
an installed kvjax finds them there, and the license the metadata declares is in the repo."""
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_ships_configs_as_package_data():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"]["kvjax.configs"] == "configs"
    # every configs/ subdirectory is a data-only package of its own (setuptools warns about an
    # importable data directory missing from `packages`), shipping its TOML files
    data = {"kvjax.configs." + d.name for d in (ROOT / "configs").iterdir() if d.is_dir()}
    assert data == {"kvjax.configs.models", "kvjax.configs.workloads"}
    assert setuptools["package-data"] == {name: ["*.toml"] for name in data}
    # the package list is explicit (to add kvjax.configs): every package directory must be in it
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in ROOT.glob("kvjax/**/__init__.py")}
    on_disk |= {".".join(p.parent.relative_to(ROOT).parts) for p in ROOT.glob("pallas_kernels/**/__init__.py")}
    assert on_disk | {"kvjax.configs"} | data == set(setuptools["packages"])


def test_installed_layout_finds_its_configs(tmp_path):
    """A wheel's layout: site/kvjax/configs/{models,workloads}, no top-level configs/ anywhere."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "kvjax", site / "kvjax", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "configs", site / "kvjax" / "configs")
    code = ("from kvjax.model_spec import available_models, MODELS_DIR; from kvjax.engine.workloads import WORKLOADS_DIR;"
            "print(MODELS_DIR); print(WORKLOADS_DIR); print(','.join(available_models()))")
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    models_dir, workloads_dir, names = out.stdout.split()
    assert models_dir == str(site / "kvjax" / "configs" / "models")
    assert workloads_dir == str(site / "kvjax" / "configs" / "workloads")
    assert {"tiny", "llama-3.1-8b", "gemma-3-27b"} <= set(names.split(","))


def test_license_file_matches_the_declared_license():
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
