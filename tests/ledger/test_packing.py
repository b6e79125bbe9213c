"""`packer`: the compiled packers give what `struct.pack` gives, raise what it raises, and
their cache stays bounded."""
import struct

import pytest

from kvjax.ledger import packing
from kvjax.ledger.packing import packer


@pytest.mark.parametrize("code", ["i", "q"])
def test_packs_like_struct_pack(code):
    for values in ([], [0], [1, -2, 2**31 - 1], list(range(1000))):
        assert packer(len(values), code)(*values) == struct.pack(f"{len(values)}{code}", *values)
    with pytest.raises(struct.error):
        packer(1, "i")(2**31)
    with pytest.raises(struct.error):
        packer(2, code)(1)  # too few values


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(packing, "_MAX", 8)
    monkeypatch.setattr(packing, "_PACKERS", {})
    for n in range(100):
        assert packer(n)(*range(n)) == struct.pack(f"{n}i", *range(n))
        assert len(packing._PACKERS) <= 8
