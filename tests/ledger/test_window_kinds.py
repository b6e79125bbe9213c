"""The attention kinds of a window (`kvjax.ledger.window_kinds`): which kind each window gets,
each override on its own, a cross cache whose window is shorter than `max_seq_len` (a cross
kind, not a sliding one), and the rule that arithmetic on a window's size lives in the kinds
module only (so the visibility rule is not spelled again elsewhere)."""
from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest
from ledger_helpers import TPB, make_manager

import kvjax.ledger
from kvjax import InvalidRequestError, Request
from kvjax.ledger.block_columns import PLACEHOLDER_BLOCK_ID
from kvjax.ledger.sequence import SequenceWindow
from kvjax.ledger.window_kinds import CrossAttentionWindow, FullAttentionWindow, SlidingWindow, window_kind
from kvjax.ledger.window_manager import WindowBlockManager

LEDGER = pathlib.Path(kvjax.ledger.__file__).resolve().parent
KINDS_MODULE = "window_kinds.py"
IDENTITY_OPS = (ast.Eq, ast.NotEq, ast.Is, ast.IsNot, ast.In, ast.NotIn)  # a lookup, not a rule


def windows(m):
    return m._bm.windows


def sequence_window(num_front_removed: int, beams: int = 1) -> SequenceWindow:
    sw = SequenceWindow("r", beams)
    sw.num_front_removed = num_front_removed
    return sw


# ---------------------------------------------------------------------------- which kind
def test_each_window_gets_the_manager_of_its_kind():
    full = make_manager()
    assert [type(wm) for wm in windows(full)] == [FullAttentionWindow]
    vswa = make_manager(num_layers=2, attention_windows=(8, 64))
    assert [(type(wm), wm.window) for wm in windows(vswa)] == [(SlidingWindow, 8), (FullAttentionWindow, 64)]
    assert vswa._bm.detaching == [windows(vswa)[0]]
    assert full._bm.detaching == []
    cross = make_manager(cache_type="cross")
    assert [type(wm) for wm in windows(cross)] == [CrossAttentionWindow]
    # a cross cache's window stays a cross window even when shorter than max_seq_len
    short_cross = make_manager(cache_type="cross", attention_windows=(8,))
    assert window_kind(short_cross.config, 8) is CrossAttentionWindow
    assert short_cross._bm.detaching == []


def test_kind_capabilities():
    assert (FullAttentionWindow.detaches, FullAttentionWindow.grows, FullAttentionWindow.stores) == (False, True, True)
    assert (SlidingWindow.detaches, SlidingWindow.grows, SlidingWindow.stores) == (True, True, True)
    assert (CrossAttentionWindow.detaches, CrossAttentionWindow.grows, CrossAttentionWindow.stores) == (False, False, False)
    assert make_manager(cache_type="cross", enable_block_reuse=True)._bm.reuse is False
    assert make_manager(enable_block_reuse=True)._bm.reuse is True
    assert make_manager(cache_type="cross")._bm.grows is False


def test_the_shared_manager_is_abstract():
    m = make_manager()
    wm = windows(m)[0]
    with pytest.raises(TypeError):
        WindowBlockManager(0, 64, m.config, m._bm.tree, m._bm.recorder, None, lambda: 0.0)  # type: ignore[abstract]
    assert isinstance(wm, WindowBlockManager)


# ---------------------------------------------------------------------------- visibility
def test_first_visible_per_kind():
    full = windows(make_manager())[0]
    sliding = windows(make_manager(attention_windows=(8,)))[0]
    cross = windows(make_manager(cache_type="cross", attention_windows=(8,)))[0]
    for q in range(40):
        assert full.first_visible(q) == 0
        assert cross.first_visible(q) == 0
        assert sliding.first_visible(q) == max(0, q - 8 + 1)


def test_detach_end_counts_the_blocks_no_later_query_sees():
    full = windows(make_manager())[0]
    sliding = windows(make_manager(attention_windows=(8,)))[0]
    for q in range(60):
        assert full.detach_end(q) == 0
        # block p (keys p*TPB .. p*TPB+TPB-1) is invisible once its last key is before first_visible
        expected = sum(1 for p in range(20) if (p + 1) * TPB <= max(0, q - 8 + 1))
        assert sliding.detach_end(q) == expected
    assert sliding.detach_end(7) == 0 and sliding.detach_end(10) == 0 and sliding.detach_end(11) == 1


def test_released_visible():
    sliding = windows(make_manager(attention_windows=(8,)))[0]
    full = windows(make_manager())[0]
    nothing_released = sequence_window(0)
    assert not sliding.released_visible(nothing_released, 0)
    assert not full.released_visible(nothing_released, 50)
    one_released = sequence_window(1)  # keys 0..3 released
    assert sliding.released_visible(one_released, 10)  # sees keys 3..10
    assert not sliding.released_visible(one_released, 11)  # sees keys 4..11
    assert sliding.released_visible(one_released, 0)


def test_detach_limit():
    sliding = windows(make_manager(attention_windows=(8,)))[0]
    full = windows(make_manager())[0]
    assert full.detach_limit(sequence_window(0), 0) is None
    # front block 0 (keys 0..3) leaves once the oldest query reaches 11, i.e. at 12 tokens
    # (13 with one draft): up to 11 (12) tokens nothing detaches
    assert sliding.detach_limit(sequence_window(0), 0) == 11
    assert sliding.detach_limit(sequence_window(0), 1) == 12
    assert sliding.detach_limit(sequence_window(2), 0) == 19


@pytest.mark.parametrize("window", [3, 8, 13, 30])
def test_detach_limit_inverts_first_visible(window):
    """At `detach_limit` tokens nothing is due; one token more and the front block is."""
    sliding = windows(make_manager(attention_windows=(window,)))[0]
    for nfr in range(6):
        for drafts in range(3):
            limit = sliding.detach_limit(sequence_window(nfr), drafts)
            assert limit is not None
            oldest_at_limit = limit - 1 - drafts  # the oldest query of the next forward at `limit` tokens
            assert sliding.detach_end(oldest_at_limit) <= nfr < sliding.detach_end(oldest_at_limit + 1)


def test_detach_invisible_releases_exactly_the_invisible_front_blocks():
    m = make_manager(attention_windows=(8,), primary_blocks=16)
    m.add_sequence(Request("r", list(range(1, 21)), max_new_tokens=4))  # 5 blocks, oldest query 20 - 1 = 19
    sw = m._seqs["r"].windows[0]
    wm = windows(m)[0]
    assert sw.num_front_removed == 0  # a prompt is held whole until its first added token
    wm.detach_invisible(sw, 19)  # sees keys 12..19: blocks 0..2 go
    assert sw.num_front_removed == 3
    wm.detach_invisible(sw, 19)  # nothing more
    assert sw.num_front_removed == 3
    assert m.block_ids("r")[0][:3] == [PLACEHOLDER_BLOCK_ID] * 3
    m._live.set_limit(m._seqs["r"])  # what `add_token` does after its detach: the fast path's new limit
    m.verify_integrity()


# ---------------------------------------------------------------------------- matching and reuse
def test_real_blocks_and_reuse_safe():
    full = windows(make_manager())[0]
    sliding = windows(make_manager(attention_windows=(8,)))[0]
    matched = [3, 5, 7]
    assert full.real_blocks(matched) is matched
    assert sliding.real_blocks([None, None, 4, 6]) == [4, 6]
    assert full.reuse_safe([], 12) and full.reuse_safe([4], 8)
    assert sliding.reuse_safe([], 12)
    # a gap ending at 4: reuse from 12 on is safe (12 >= 4 + 8), from 8 it is not
    assert sliding.reuse_safe([4], 12)
    assert not sliding.reuse_safe([4], 8)
    # a gap after the reuse point does not matter
    assert sliding.reuse_safe([16], 8)


def test_sliding_admission_leaves_unread_matched_positions_as_placeholders():
    m = make_manager(attention_windows=(8,), primary_blocks=32, enable_block_reuse=True)
    prompt = list(range(1, 26))  # 25 tokens: 24 reusable (6 blocks)
    m.add_sequence(Request("a", prompt, max_new_tokens=2))
    m.store_context_blocks("a")
    assert m.add_sequence(Request("b", prompt, max_new_tokens=2)) == 24
    # the first new query (24) sees keys 17..24: blocks 0..3 (keys 0..15) are never read
    (ids,) = m.block_ids("b")
    assert ids[:4] == [PLACEHOLDER_BLOCK_ID] * 4 and PLACEHOLDER_BLOCK_ID not in ids[4:]
    assert ids[4:6] == m.block_ids("a")[0][4:6]
    m.verify_integrity()


def test_context_blocks_split_per_kind():
    full = windows(make_manager(max_beam_width=2))[0]
    cross = windows(make_manager(cache_type="cross", max_beam_width=2))[0]
    m = make_manager(max_beam_width=2)  # sequences built by validation, as admission builds them
    seq_full = _sequence(m, Request("r", list(range(1, 9)), max_new_tokens=2, beam_width=2))  # 8 tokens: 2 full blocks
    seq_part = _sequence(m, Request("s", list(range(1, 8)), max_new_tokens=2, beam_width=2))  # 7 tokens
    seq_one = _sequence(m, Request("t", list(range(1, 8)), max_new_tokens=2))
    assert full.context_blocks(seq_full, False) == (2, 0)  # reuse off: a full last block is shared
    assert full.context_blocks(seq_full, True) == (1, 1)  # reuse on: the last block is per beam
    assert full.context_blocks(seq_part, False) == (1, 1)
    assert full.context_blocks(seq_one, True) == (2, 0)
    mc = make_manager(cache_type="cross", max_beam_width=2)
    seq_cross = _sequence(mc, Request("c", [], max_new_tokens=2, beam_width=2, encoder_len=7))
    assert cross.context_blocks(seq_cross, False) == (2, 0)  # every beam shares the encoder's blocks


def _sequence(m, request):
    from kvjax.ledger.validation import validate_request

    bm = m._bm
    return validate_request(request, bm.config, len(bm.windows), bm.is_cross, {}, None, True, m._live.tok)


# ---------------------------------------------------------------------------- scheduler counts
def test_cross_kind_counts():
    m = make_manager(cache_type="cross", max_beam_width=2)
    wm = windows(m)[0]
    req = Request("c", [], max_new_tokens=5, beam_width=2, encoder_len=9, num_draft_tokens=2)
    assert wm.draft_blocks(req) == 0
    assert m.remaining_blocks_to_completion(req) == 3
    assert m.needed_blocks_one_step(req) == 3
    m.add_sequence(req)
    seq = m._seqs["c"]
    assert wm.step_blocks(seq, 2, 2) == 0
    assert wm.step_blocks_many([seq], 2).tolist() == [0]
    assert m.remaining_blocks_to_completion("c") == 0
    assert m.remaining_blocks_to_completion_many(["c"]).tolist() == [0]
    assert m.needed_blocks_one_step_many(["c"]).tolist() == [0]


def test_full_kind_step_counts_match_the_scalar_form():
    m = make_manager(primary_blocks=32, max_beam_width=2)
    m.add_sequence(Request("a", list(range(1, 8)), max_new_tokens=9))
    m.add_sequence(Request("b", list(range(1, 5)), max_new_tokens=9, beam_width=2))
    m.add_sequence(Request("c", list(range(1, 10)), max_new_tokens=3, num_draft_tokens=2))
    wm = windows(m)[0]
    ids = ["a", "b", "c"]
    seqs = [m._seqs[r] for r in ids]
    for steps in (1, 2):
        many = wm.step_blocks_many(seqs, steps)
        assert many.dtype == np.int64
        assert many.tolist() == [wm.step_blocks(s, steps, s.beam_width) for s in seqs]
    assert m.remaining_blocks_to_completion_many(ids).tolist() == [m.remaining_blocks_to_completion(r) for r in ids]


def test_sliding_kind_remaining_blocks_stay_within_the_window():
    m = make_manager(attention_windows=(8,), primary_blocks=32)
    req = Request("a", list(range(1, 5)), max_new_tokens=40)
    # the peak: ceil(8 / 4) + 1 = 3 blocks, not the 11 a full window would need
    assert m.remaining_blocks_to_completion(req) == 3
    m.add_sequence(req)
    assert m.remaining_blocks_to_completion("a") == 2
    assert m.remaining_blocks_to_completion_many(["a"]).tolist() == [2]


# ---------------------------------------------------------------------------- a short cross window
def test_a_cross_cache_with_a_short_window_never_detaches_or_grows():
    m = make_manager(cache_type="cross", attention_windows=(8,), primary_blocks=16)
    m.add_sequence(Request("c", [], max_new_tokens=4, encoder_len=30))
    (ids,) = m.block_ids("c")
    assert len(ids) == 8 and PLACEHOLDER_BLOCK_ID not in ids
    with pytest.raises(InvalidRequestError, match="does not grow"):
        m.add_token("c", 1)
    with pytest.raises(InvalidRequestError, match="does not grow"):
        m.add_tokens(["c"], [1])
    assert m.block_ids("c") == [ids]
    m.verify_integrity()


# ---------------------------------------------------------------------------- one home per rule
def window_arithmetic(source: str) -> list[str]:
    """Arithmetic (`+ - * // %`, and ordering comparisons) on a window's size: a name or
    attribute `window` as an operand. Such a line restates a kind's rule."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp):
            operands = [node.left, node.right]
        elif isinstance(node, ast.Compare) and not all(isinstance(o, IDENTITY_OPS) for o in node.ops):
            operands = [node.left, *node.comparators]
        else:
            continue
        for o in operands:
            if (isinstance(o, ast.Name) and o.id == "window") or (isinstance(o, ast.Attribute) and o.attr == "window"):
                out.append(ast.unparse(node))
                break
    return out


def test_window_arithmetic_finder_catches_the_rule_in_its_spellings():
    assert window_arithmetic("x = q - wm.window + 1")
    assert window_arithmetic("x = (p + 1) * tpb <= first - wm.window")
    assert window_arithmetic("ok = length >= last_gap + window")
    assert window_arithmetic("if final > self.window: pass")
    assert not window_arithmetic("x = wm.window\ny = {wm.window: 1}\nz = w == wm.window\nif window is None: pass")


def test_window_arithmetic_lives_in_the_kinds_module_only():
    """The visibility rule (`query - window + 1`) and every other rule computed from a window's
    size is stated by a kind: another ledger module asks the window (`first_visible`,
    `detach_end`, `released_visible`, `detach_limit`, ...)."""
    found = {p.name: window_arithmetic(p.read_text()) for p in sorted(LEDGER.glob("*.py"))}
    assert found[KINDS_MODULE], "the kinds module states the rules"
    elsewhere = {name: lines for name, lines in found.items() if lines and name != KINDS_MODULE}
    assert not elsewhere, f"window arithmetic outside {KINDS_MODULE}: {elsewhere}"


def test_no_ledger_module_but_the_kinds_asks_what_kind_a_window_is():
    """`config.is_swa` picks a window's kind in one place; the rest ask the window."""
    users = sorted(p.name for p in LEDGER.glob("*.py") if "is_swa" in p.read_text())
    assert users == [KINDS_MODULE]
