"""`TrackedSequence`: the ledger's record of one live request (TensorRT-LLM's `GenerationRequest`).

Holds beam 0's tokens (what keys are built from) in one of two places: a Python list (the
prompt at admission, then every token single `add_token` calls append, one list append each)
or a row of the manager's `TokenStore` (columns, which the batched `add_tokens` writes for
many sequences at once; it moves a sequence there on its first batched step). And per window
the block ids of every beam as int arrays plus the rows of the window's `SlotTable` that mirror
their primary slots. A referenced block never changes slot (only free blocks are offloaded,
onboards happen before a block joins a sequence), so the slot rows are kept incrementally and
block tables are gathered from them directly.
"""
from __future__ import annotations

import array
from collections.abc import Hashable, Sequence
from typing import NamedTuple

from kvjax._math import ceil_div
from kvjax.ledger.block_columns import PLACEHOLDER_BLOCK_ID
from kvjax.ledger.block_key import cache_salt_id
from kvjax.ledger.token_path import PLAIN_UNIT, TokenPath, encode_tokens, encode_with_extra, mm_keys_by_block
from kvjax.ledger.token_store import TokenStore
from kvjax.request import Request


class StoreCursor(NamedTuple):
    """Where a sequence's storing resumes in one window: the tree node and position id of its
    last full block known stored (ids survive splits; `RadixTree.holds` tells whether the node
    still holds it, `WindowBlockManager.cursor_position` finds it wherever it went) and how
    many full blocks that makes."""

    node: int
    pid: int
    full_blocks: int


class RecurrentCursor:
    """Where one sequence's recurrent state is (a `RecurrentStatesWindow`): its live state,
    `S(pos)` (the state after its first `pos` tokens), in block `live` (-1: none yet, the
    zero state) at chain position `(pos - 1) // tokens_per_block`; block `write`, which the
    next step writes (-1: none held; the live block itself when states are updated in
    place); `end`: the token count the begun step's state covers (0: no step begun)."""

    __slots__ = ("pos", "live", "write", "end")

    def __init__(self, pos: int, live: int, write: int) -> None:
        self.pos = pos
        self.live = live
        self.write = write
        self.end = 0

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.pos, self.live, self.write, self.end)

    def off_chain(self) -> int:
        """The write block when the sequence holds it outside its chain (else -1)."""
        return self.write if self.write >= 0 and self.write != self.live else -1


class SequenceWindow:
    """One sequence's blocks in one window manager."""

    __slots__ = ("request_id", "blocks", "rows", "num_front_removed", "cursor", "state")

    def __init__(self, request_id: Hashable, beam_width: int) -> None:
        self.request_id = request_id  # the SlotTable files a one-beam sequence's row under it
        self.blocks: list[array.array] = [array.array("i")] if beam_width == 1 else [array.array("i") for _ in range(beam_width)]
        # rows of the window's SlotTable, one per beam (None until the first block); only the
        # SlotTable hands them out and takes them back
        self.rows: list[int] | None = None
        self.num_front_removed = 0  # leading placeholders (sliding-window detach)
        self.cursor: StoreCursor | None = None  # None: store from the root
        self.state: RecurrentCursor | None = None  # a recurrent-state window's cursor

    # ---------------------------------------------------------------- the one writer of `blocks`
    # (the window manager, admission's rows, the batched decode step and rewinds call these; the
    # slot table mirroring each beam is its caller's to keep in step)
    def append_block(self, beam: int, b: int) -> None:
        self.blocks[beam].append(b)

    def extend_blocks(self, beam: int, blocks: list[int], packed: bytes | None = None) -> None:
        """Append `blocks` to one beam (`packed`: the same ids as native int32 bytes, copied as is)."""
        if packed is None:
            self.blocks[beam].extend(blocks)
        else:
            self.blocks[beam].frombytes(packed)

    def set_block(self, beam: int, pos: int, b: int) -> None:
        """Replace the block at `pos` (a copy-on-write, or a placeholder for a detached block)."""
        self.blocks[beam][pos] = b

    def pop_block(self, beam: int) -> int:
        return self.blocks[beam].pop()

    def unique_blocks(self) -> list[int]:
        """Real blocks this sequence references, in allocation order (shared blocks once); a
        recurrent-state chain's placeholders are left out and its off-chain write block is
        last."""
        beams = self.blocks
        state = self.state
        if state is not None:
            held = [b for b in beams[0] if b >= 0]
            if state.off_chain() >= 0:
                held.append(state.write)
            return held
        if len(beams) == 1:
            return beams[0][self.num_front_removed :].tolist()
        out: list[int] = []
        for pos in range(len(beams[0])):
            first = None
            for beam in beams:
                b = beam[pos]
                if b == PLACEHOLDER_BLOCK_ID or b == first:
                    continue
                if first is None:
                    first = b
                out.append(b)
        return out


class TrackedSequence:
    __slots__ = (
        "request_id",
        "request",
        "prompt_len",
        "tokens",
        "store",
        "row",
        "limit",
        "extra_ids",
        "beam_width",
        "lora_task_id",
        "salt_id",
        "signature",
        "mm_items",
        "retention",
        "max_new_tokens",
        "num_draft_tokens",
        "context_position",
        "context_retention",
        "prepopulated",
        "is_cross",
        "windows",
        "admit_counts",
        "batchable",
        "prompt_path",
    )

    def __init__(
        self, request: Request, num_windows: int, is_cross: bool, store: TokenStore, tokens: Sequence[int] | None = None
    ) -> None:
        self.request_id: Hashable = request.request_id
        self.request = request
        self.is_cross = is_cross
        # its tokens as a list (None: they are in row `row` of `store`; see `to_store`)
        self.tokens: list[int] | None = list(request.prompt if tokens is None else tokens)
        self.store = store
        self.row = -1
        # while the tokens are a list: the count below which `add_token` only appends (the
        # manager sets it, `BlockManager.fast_limit`; 0 switches the lock-free append off)
        self.limit = 0
        self.extra_ids: list[int] | None = None if request.extra_ids is None else list(request.extra_ids)
        if is_cross:
            assert request.encoder_len is not None  # validation requires it of a cross cache's request
            self.prompt_len = request.encoder_len
        else:
            self.prompt_len = len(self.tokens)
        self.beam_width = request.beam_width
        self.lora_task_id = request.lora_task_id
        salt = request.cache_salt
        self.salt_id = None if salt is None else cache_salt_id(salt)
        self.signature = (self.extra_ids is not None, self.lora_task_id, self.salt_id)
        self.mm_items = request.mm_items
        self.retention = request.retention
        self.max_new_tokens = request.max_new_tokens
        self.num_draft_tokens = request.num_draft_tokens
        self.context_position = self.prompt_len
        self.prepopulated = 0
        rid, beams = self.request_id, self.beam_width
        self.windows = [SequenceWindow(rid, beams)]
        if num_windows > 1:
            self.windows += [SequenceWindow(rid, beams) for _ in range(num_windows - 1)]
        # (reused, missed, alloc_total, alloc_new) blocks of its admission (`request_stats`)
        self.admit_counts: list[int] = [0, 0, 0, 0]
        self.context_retention: list[tuple[int | None, float | None]] | None = None
        # `add_tokens` may grow it in a batch with others (one beam, no extra ids,
        # no retention, not a cross cache)
        self.batchable = self.beam_width == 1 and self.extra_ids is None and not is_cross and self.retention is None
        # the prompt's tokens as admission's walk encoded them (prompt tokens never change):
        # storing the context blocks reuses them instead of encoding the tokens again
        self.prompt_path: TokenPath | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens so far (a cross cache never grows: its encoder length)."""
        tokens = self.tokens
        if self.is_cross:
            return self.prompt_len
        return len(tokens) if tokens is not None else self.store.count_of[self.row]

    def to_store(self) -> None:
        """Move the token list into a new row of the token store (a batched step writes the
        store only); the prompt's encoding from admission's walk is reused."""
        tokens = self.tokens
        assert tokens is not None  # in the list
        path = self.prompt_path
        if path is not None and path.base == 0 and path.unit == PLAIN_UNIT and path.num_tokens <= len(tokens):
            prefix, rest = path.content, tokens[path.num_tokens :]  # the walk's bytes, shared
        else:
            prefix, rest = encode_tokens(tokens), []
        store = self.store
        r = self.row = store.admit(self.request_id, prefix, self.prompt_len + self.max_new_tokens)
        store.extend(r, rest)
        store.set_limit(r, self.limit)  # the limit moves with the tokens
        self.tokens = None
        self.limit = 0

    def to_list(self) -> None:
        """Move the tokens out of the store into a list again (single `add_token` calls)."""
        assert self.tokens is None  # in the store
        store, r = self.store, self.row
        self.tokens = store.tokens(r, 0, store.count_of[r])
        self.limit = store.limit_of[r]
        store.release(self.request_id, r)
        self.row = -1

    def release(self) -> None:
        """The sequence leaves: its row of the store, if any, goes back."""
        if self.tokens is None:
            self.store.release(self.request_id, self.row)
            self.row = -1

    def append(self, token: int) -> None:
        """One checked token (on a locked path)."""
        if self.tokens is not None:
            self.tokens.append(token)
        else:
            self.store.append(self.row, token)

    def overwrite(self, pos: int, token: int) -> None:
        """Token `pos` (a generated one) becomes `token` (a pending token's id, or its mark)."""
        if self.tokens is not None:
            self.tokens[pos] = token
        else:
            self.store.overwrite(self.row, pos, token)

    def truncate(self, n: int) -> None:
        """Keep the first `n` tokens (a rewind)."""
        if self.tokens is not None:
            del self.tokens[n:]
        else:
            self.store.truncate(self.row, n)

    def token_list(self, start: int = 0, end: int | None = None) -> list[int]:
        """Beam 0's tokens `[start, end)` (to the last one by default), as ints."""
        if self.tokens is not None:
            return self.tokens[start:end]
        store, r = self.store, self.row
        return store.tokens(r, start, store.count_of[r] if end is None else end)

    def units(self, start: int, end: int) -> bytes:
        """Beam 0's tokens `[start, end)` as native int32 bytes (what the tree compares)."""
        if self.tokens is not None:
            return encode_tokens(self.tokens[start:end])
        return self.store.units(self.row, start, end)

    # ------------------------------------------------------------------ keys
    def token_path(self, first_block: int, end_token: int, tokens_per_block: int) -> TokenPath:
        """Tokens `[first_block * tokens_per_block, end_token)` encoded for the radix tree
        (raises `struct.error` for a token id outside int32)."""
        cached = self.prompt_path
        if cached is not None and end_token == cached.num_tokens and tokens_per_block == cached.tokens_per_block:
            o = first_block * cached.block_bytes  # the same path from `first_block` (one C-level copy)
            return TokenPath(cached.content[o:], first_block, self.signature, tokens_per_block, end_token, cached.mm)
        start = first_block * tokens_per_block
        if self.extra_ids is not None:
            content = encode_with_extra(self.token_list(start, end_token), self.extra_ids[start:end_token])
        else:
            content = self.units(start, end_token)
        mm = mm_keys_by_block(self.mm_items, tokens_per_block, first_block, end_token) if self.mm_items else None
        return TokenPath(content, first_block, self.signature, tokens_per_block, end_token, mm)

    def block_priority(self, block_index: int, tokens_per_block: int) -> tuple[int | None, float | None]:
        """Retention (priority, duration) of block `block_index`: its range's for context blocks,
        the decode retention for blocks starting at or after the prompt end."""
        r = self.retention
        if r is None:
            return None, None
        if block_index * tokens_per_block >= self.prompt_len:
            return r.decode_priority, r.decode_duration_s
        table = self.context_retention
        if table is None:
            table = self.context_retention = self._retention_table(tokens_per_block)
        return table[block_index]

    def block_priorities(self, first: int, stop: int, tokens_per_block: int) -> list[tuple[int | None, float | None]]:
        """`block_priority` of blocks `first .. stop - 1`, in order (one slice of the context
        table, then the decode retention)."""
        count = stop - first
        r = self.retention
        if r is None or count <= 0:
            return [(None, None)] * max(count, 0)
        n_ctx = ceil_div(self.prompt_len, tokens_per_block)  # blocks holding a prompt token
        out: list[tuple[int | None, float | None]] = []
        if first < n_ctx:
            table = self.context_retention
            if table is None:
                table = self.context_retention = self._retention_table(tokens_per_block)
            out = table[first : min(stop, n_ctx)]
        if stop > n_ctx:
            out += [(r.decode_priority, r.decode_duration_s)] * (stop - max(first, n_ctx))
        return out

    def _retention_table(self, tpb: int) -> list[tuple[int | None, float | None]]:
        """Per context block (priority, duration): the range holding the block's first token."""
        n = ceil_div(self.prompt_len, tpb)
        table: list[tuple[int | None, float | None]] = [(None, None)] * n
        retention = self.retention
        assert retention is not None  # only `block_priority` of a request with retention builds it
        for r in retention.ranges:
            lo = ceil_div(r.start, tpb)
            hi = n if r.end is None else min(n, ceil_div(r.end, tpb))
            if hi > lo:
                table[lo:hi] = [(r.priority, r.duration_s)] * (hi - lo)
        return table
