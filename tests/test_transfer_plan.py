"""`kvjax.transfer_plan`: a neutral module (importing it loads neither the ledger nor the device
side), whose plans never narrow an index silently."""
import subprocess
import sys

import numpy as np
import pytest

from kvjax.transfer_plan import TransferKind, TransferPlan


def test_import_loads_neither_ledger_nor_device():
    code = (
        "import sys, kvjax.transfer_plan\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('kvjax.ledger', 'kvjax.device', 'jax')))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


GOOD = [0, 1, 2]


@pytest.mark.parametrize(
    "bad, error",
    [
        (np.array([0, 2**40, 1], np.int64), ValueError),  # would wrap to 0 in int32
        (np.array([0, -(2**31) - 1, 1], np.int64), ValueError),
        (np.array([0, 2**31, 1], np.uint64), ValueError),
        ([0, 2**31, 1], ValueError),
        ([0, 2**70, 1], TypeError),
        (np.array([0.0, 1.5, 2.0]), TypeError),  # would truncate to 1
        (np.array([0.0, 1.0, 2.0]), TypeError),  # floats are not indices, even whole ones
        ([0, float("nan"), 2], TypeError),
        (np.array([True, False, True]), TypeError),
        ([0, True, 2], TypeError),  # one bool among ints would become 1
        (["0", "1", "2"], TypeError),
        (np.array([[0, 1, 2]]), ValueError),
        ([0, 1], ValueError),  # length differs from the other columns
    ],
)
@pytest.mark.parametrize("field", ["src", "dst", "num_tokens", "pool"])
def test_no_silent_narrowing(bad, error, field):
    cols = {"kind": [int(TransferKind.COPY)] * 3, "pool": GOOD, "src": GOOD, "dst": GOOD, "num_tokens": GOOD}
    cols[field] = bad
    with pytest.raises(error):
        TransferPlan(**cols)


def test_integer_dtypes_that_fit_are_converted():
    wide = np.array([0, 2**31 - 1, 7], np.int64)
    plan = TransferPlan(np.array([2, 2, 2], np.uint8), [0, 0, 0], wide, wide, [1, 1, 1])
    assert all(getattr(plan, f).dtype == np.int32 for f in ("kind", "pool", "src", "dst", "num_tokens"))
    assert plan.src.tolist() == [0, 2**31 - 1, 7]
    empty = TransferPlan([], [], [], [], [])
    assert len(empty) == 0 and empty.kind.dtype == np.int32


def test_from_ops_refuses_what_would_narrow():
    assert TransferPlan.from_ops([(TransferKind.OFFLOAD, 0, 3, 2, 4)]).src.tolist() == [3]
    with pytest.raises(ValueError):
        TransferPlan.from_ops([(TransferKind.OFFLOAD, 0, 2**32 + 3, 2, 4)])
    with pytest.raises(TypeError):
        TransferPlan.from_ops([(TransferKind.OFFLOAD, 0, 3.0, 2, 4)])
    with pytest.raises(ValueError):
        TransferPlan.from_ops([(TransferKind.OFFLOAD, 0, 3, 2)])
