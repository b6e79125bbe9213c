"""The geometry digest: stable, sensitive to every field, and a mismatch refused by name."""
from __future__ import annotations

import subprocess
import sys

import pytest
from disagg_helpers import ROOT, geometry

from kvjax.disagg import GeometryMismatchError, KVGeometry, TransferConfigError


def test_digest_is_stable_across_processes():
    code = ("import sys; sys.path.insert(0, 'tests/disagg'); from disagg_helpers import geometry; "
            "print(geometry().digest)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "123", "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == geometry().digest
    assert len(geometry().digest) == 64


@pytest.mark.parametrize("kw, field", [
    (dict(model="other"), "model"),
    (dict(dtype="bfloat16"), "dtype"),
    (dict(tokens_per_block=8), "tokens_per_block"),
    (dict(layout="layer_first"), "layout"),
    (dict(num_kv_heads=4), "kv_heads_per_layer"),
    (dict(head_dim=16), "head_dim_per_layer"),
    (dict(attention_windows=(16, 64)), "layer_windows"),
])
def test_each_field_changes_the_digest_and_is_named(kw, field):
    a, b = geometry(), geometry(**kw)
    assert a.digest != b.digest
    assert field in a.diff(b.fields())
    with pytest.raises(GeometryMismatchError, match=field) as e:
        a.check_compatible(b.fields(), b.digest)
    assert field in e.value.fields


def test_policy_fields_do_not_change_the_digest():
    assert geometry().digest == geometry(primary_blocks=32, enable_block_reuse=False, max_seq_len=64).digest


def test_tp_layout_is_part_of_the_digest():
    cfg = geometry()
    tp2 = KVGeometry(**{**cfg.__dict__, "tp_size": 2, "tp_rank": 1})
    assert set(cfg.diff(tp2.fields())) == {"tp_size", "tp_rank"}
    with pytest.raises(TransferConfigError):
        KVGeometry(**{**cfg.__dict__, "tp_size": 2, "tp_rank": 2})


def test_equal_fields_with_a_wrong_digest_are_refused():
    g = geometry()
    with pytest.raises(GeometryMismatchError, match="digest"):
        g.check_compatible(g.fields(), "0" * 64)
