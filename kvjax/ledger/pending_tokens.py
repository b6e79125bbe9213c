"""Pending tokens: a generated token's position reserved before its id is known.

An engine that schedules step n+1 while step n still runs on the device (kvjax.engine.core,
"overlap") must grow each decoding sequence by the token step n is sampling before the host
has read it back: the position needs its block (and slot) now, for step n+1's forward to
write its KV. `add_pending_tokens` does what `add_tokens` would with that token, holding
`PENDING_TOKEN` in its place; `set_pending_tokens` writes the ids once they arrive.

Invariants (checked by `verify`, part of `verify_integrity`):
  * a pending token is its sequence's newest token, generated (past the prompt), beam width 1,
    and the only position holding `PENDING_TOKEN`;
  * no stored block covers it: storing covers materialised tokens only, and the newest token
    is never materialised (`LiveSequences.materialised`), so a block holding an unknown id is
    never hashed, matched or published;
  * its sequence's fast-path limit is 0, so `add_token` / `add_tokens` take the checked path,
    which refuses another token (`InvalidRequestError`) until the id is set: the pending token
    stays the newest.
A `rewind` over it drops it; `remove_sequence` drops it with the sequence.
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import numpy as np

from kvjax.errors import DuplicateRequestError, IntegrityError, InvalidArgumentError, InvalidRequestError
from kvjax.ledger import decode_batch
from kvjax.validation import INT32_MAX, check_id_list

if TYPE_CHECKING:
    from kvjax.ledger.block_manager import BlockManager
    from kvjax.ledger.live_sequences import LiveSequences
    from kvjax.ledger.sequence import TrackedSequence

#: What a pending position holds until `set_pending_tokens` (never a token id: ids are >= 0).
PENDING_TOKEN = -1


def refuse_growth(live: LiveSequences, request_id: Hashable) -> None:
    """`InvalidRequestError` if the sequence's newest token is still pending."""
    if request_id in live.pending:
        raise InvalidRequestError(
            f"request {request_id!r}: its newest token is pending (set_pending_tokens first)")


def _distinct(live: LiveSequences, ids: list | tuple) -> list[TrackedSequence]:
    seqs = live.of(ids)  # an unknown id raises UnknownRequestError
    if len(set(ids)) != len(ids):
        seen: set = set()
        for r in ids:
            if r in seen:
                raise DuplicateRequestError(f"request id {r!r} appears twice in request_ids")
            seen.add(r)
    return seqs


def add_pending(bm: BlockManager, live: LiveSequences, request_ids) -> bool:
    """`KVCacheManager.add_pending_tokens` (under the lock). Returns whether blocks changed."""
    ids = check_id_list("request_ids", request_ids)
    seqs = _distinct(live, ids)
    for seq in seqs:
        if seq.beam_width != 1 or seq.is_cross or seq.extra_ids is not None:
            raise InvalidRequestError(
                f"request {seq.request_id!r}: pending tokens need one beam, no extra ids, self-attention")
        refuse_growth(live, seq.request_id)
    if not ids:
        return False
    # every check (capacity, max_seq_len) is add_tokens': it raises with nothing changed
    changed = decode_batch.add_tokens(bm, live, ids, np.zeros(len(ids), dtype=np.int32))
    pending = live.pending
    for seq in seqs:
        at = seq.num_tokens - 1
        seq.overwrite(at, PENDING_TOKEN)
        pending[seq.request_id] = at
        live.set_limit(seq)  # 0: the next token takes the checked path
    return changed


def fill(live: LiveSequences, request_ids, tokens) -> None:
    """`KVCacheManager.set_pending_tokens` (under the lock): every check first."""
    ids = check_id_list("request_ids", request_ids)
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise InvalidArgumentError(f"tokens must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        vals = tokens.tolist()
    else:
        vals = check_id_list("tokens", tokens)
    if len(vals) != len(ids):
        raise InvalidArgumentError(f"set_pending_tokens got {len(ids)} request ids and {len(vals)} tokens")
    seqs = _distinct(live, ids)
    pending = live.pending
    for seq, t in zip(seqs, vals, strict=True):
        if type(t) is not int or not 0 <= t <= INT32_MAX:
            raise InvalidRequestError(f"token must be an int in [0, 2**31), got {t!r}")
        if seq.request_id not in pending:
            raise InvalidRequestError(f"request {seq.request_id!r} has no pending token")
    for seq, t in zip(seqs, vals, strict=True):
        seq.overwrite(pending.pop(seq.request_id), t)
        live.set_limit(seq)


def verify(bm: BlockManager, live: LiveSequences) -> None:
    """Raise `IntegrityError` unless every pending token keeps the module's invariants."""
    tpb = bm.tokens_per_block
    for rid, at in live.pending.items():
        seq = live.seqs.get(rid)
        if seq is None:
            raise IntegrityError(f"pending token of request {rid!r}, which is not live")
        if seq.beam_width != 1 or seq.is_cross or at != seq.num_tokens - 1 or at < seq.prompt_len:
            raise IntegrityError(f"request {rid!r}: pending position {at} is not its newest generated token")
        if live.materialised(seq) > at:
            raise IntegrityError(f"request {rid!r}: its pending position {at} counts as materialised")
        for sw in seq.windows:
            if sw.cursor is not None and sw.cursor.full_blocks * tpb > at:
                raise IntegrityError(f"request {rid!r}: a stored block covers its pending position {at}")
    for rid, seq in live.seqs.items():
        if seq.is_cross:
            continue
        marks = [i for i, t in enumerate(seq.token_list()) if t == PENDING_TOKEN]
        want = [live.pending[rid]] if rid in live.pending else []
        if marks != want:
            raise IntegrityError(f"request {rid!r}: pending marks at {marks}, the ledger files {want}")
