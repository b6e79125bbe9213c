"""`add_token`'s locked path for one sequence: every check of its token, then growth (a block
when the token starts one), the append, the detach of blocks no query sees and the new limit. The
facade's `add_token` and the batched decode step (`decode_batch`, for rows that need more
than a batched append) both run it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.errors import InvalidRequestError
from kvjax.ledger.validation import check_beam_token, check_token_arg
from kvjax.validation import INT32_MAX

if TYPE_CHECKING:
    from kvjax.ledger.block_manager import BlockManager
    from kvjax.ledger.live_sequences import LiveSequences
    from kvjax.ledger.sequence import TrackedSequence


def checked_token(bm: BlockManager, seq: TrackedSequence, token, n: int) -> int:
    """Every check `add_token` makes of its `n`-th token but capacity; beam 0's token."""
    if type(token) is not int:
        token = check_token_arg(token)
    if not bm.grows:
        raise InvalidRequestError("a cross-attention cache does not grow token by token")
    if type(token) is not int or seq.beam_width != 1:
        token = check_beam_token(seq, token)
    elif not 0 <= token <= INT32_MAX:
        raise InvalidRequestError(f"token must be an int in [0, 2**31), got {token!r}")
    max_seq_len = bm.config.max_seq_len
    if n > max_seq_len:
        raise InvalidRequestError(f"request {seq.request_id!r} would exceed max_seq_len={max_seq_len}")
    return token


def add_token_slow(bm: BlockManager, live: LiveSequences, seq: TrackedSequence, token, n: int) -> None:
    """Check and append the sequence's `n`-th token (`OutOfBlocksError`, with nothing changed,
    when the block it starts finds no free one)."""
    token = checked_token(bm, seq, token, n)
    tpb = bm.tokens_per_block
    if (n - 1) % tpb == 0:
        bm.grow(seq, (n - 1) // tpb)
    seq.append(token)
    if seq.extra_ids is not None:
        seq.extra_ids.append(0)
    if bm.detaching:
        bm.detach_out_of_window(seq)
    live.set_limit(seq)
