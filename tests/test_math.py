"""`kvjax._math.ceil_div`: blocks started by a token count, for ints and integer arrays."""
import numpy as np

from kvjax._math import ceil_div


def test_ceil_div_of_ints():
    assert [ceil_div(a, 4) for a in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert ceil_div(2**40 + 1, 2**20) == 2**20 + 1  # exact beyond float precision too


def test_ceil_div_of_integer_arrays_is_elementwise():
    a = np.array([0, 1, 16, 17, 31, 32], dtype=np.int32)
    out = ceil_div(a, 16)
    assert out.dtype == np.int32
    assert out.tolist() == [0, 1, 1, 2, 2, 2]
