"""`UnifiedBlockTree`: one radix tree of block keys shared by every attention window.

A node is one block position along a token path; it holds at most one block per window
(`blocks[window]`). Children are found by exact key (a dict) and, for partial reuse, through a
bucket of children sharing the first token and constraint fields, so a partial lookup never
scans unrelated siblings. Nodes left with no block and no child are pruned up to the root.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvjax.ledger.block_key import BlockHasher, BlockKey, common_prefix_length, partial_index_key

if TYPE_CHECKING:
    from kvjax.ledger.block import Block


# Shared, never-mutated stand-in for a leaf's child map: most nodes are leaves, and a dict per
# node would weigh on the cost of storing a block.
_EMPTY: dict = {}


class TokenRun:
    """The tokens one `store` call covered (a plain sequence: no extra ids or multimodal keys),
    shared by the nodes it created. A walk that matches one of those nodes can compare the rest
    of its prompt against the run in one C-level slice comparison and follow `next_in_run`
    links instead of hashing a key per block."""

    __slots__ = ("tokens", "sig", "base")

    def __init__(self, tokens: tuple[int, ...], sig: tuple, base: int) -> None:
        self.tokens = tokens  # the sequence's tokens from position `base` on
        self.sig = sig  # (lora_task_id, cache_salt_id) of every key in the run
        self.base = base


class RadixNode:
    __slots__ = (
        "key",
        "parent",
        "children",
        "partial_index",
        "blocks",
        "depth",
        "is_full",
        "_hash",
        "attached",
        "run",
        "next_in_run",
    )

    def __init__(self, key: BlockKey | None, parent: RadixNode | None, depth: int, tokens_per_block: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[BlockKey, RadixNode] = _EMPTY
        # Children bucketed by partial_index_key, built on the first partial lookup at this node
        # (divergence points) and maintained from then on; None until then.
        self.partial_index: dict[tuple, dict[RadixNode, None]] | None = None
        self.blocks: dict[int, Block] = {}
        self.depth = depth
        self.is_full = key is not None and len(key.tokens) == tokens_per_block
        self._hash: int | None = None
        self.attached = True  # False once pruned from the tree
        self.run: TokenRun | None = None  # set when created by a plain sequence's store
        self.next_in_run: RadixNode | None = None  # the child created right after it, same run

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        toks = None if self.key is None else self.key.tokens
        return f"RadixNode(depth={self.depth}, tokens={toks}, windows={sorted(self.blocks)})"


class UnifiedBlockTree:
    """The lookup tree. Blocks attach to nodes per window; the tree owns node lifetime."""

    def __init__(self, tokens_per_block: int, hasher: BlockHasher | None = None) -> None:
        self.tokens_per_block = tokens_per_block
        self.root = RadixNode(None, None, 0, tokens_per_block)
        self.num_nodes = 0
        self.hasher = BlockHasher() if hasher is None else hasher

    # ------------------------------------------------------------------ lookups
    @staticmethod
    def child(node: RadixNode, key: BlockKey) -> RadixNode | None:
        return node.children.get(key)

    @staticmethod
    def best_partial_child(
        node: RadixNode, key: BlockKey, window: int, skip_referenced: bool
    ) -> tuple[RadixNode | None, int]:
        """Child holding a block for `window` whose key shares the most leading tokens with
        `key` (ties: the oldest child). Referenced blocks are skipped when `skip_referenced`."""
        bucket_key = partial_index_key(key)
        if bucket_key is None:
            return None, 0
        index = node.partial_index
        if index is None:
            index = node.partial_index = {}
            for child in node.children.values():
                bk = partial_index_key(child.key)
                if bk is not None:
                    index.setdefault(bk, {})[child] = None
        bucket = index.get(bucket_key)
        if not bucket:
            return None, 0
        best, best_n = None, 0
        for cand in bucket:
            blk = cand.blocks.get(window)
            if blk is None or (skip_referenced and blk.ref_count > 0):
                continue
            n = common_prefix_length(key, cand.key)
            if n > best_n:
                best, best_n = cand, n
        return best, best_n

    # ------------------------------------------------------------------ mutation
    def get_or_create_child(self, node: RadixNode, key: BlockKey) -> RadixNode:
        child = node.children.get(key)
        if child is None:
            child = RadixNode(key, node, node.depth + 1, self.tokens_per_block)
            if node.children is _EMPTY:
                node.children = {}
            node.children[key] = child
            if node.partial_index is not None:
                bucket_key = partial_index_key(key)
                if bucket_key is not None:
                    node.partial_index.setdefault(bucket_key, {})[child] = None
            self.num_nodes += 1
        return child

    def attach(self, node: RadixNode, window: int, block: Block) -> Block:
        """Attach `block` as `node`'s value for `window` unless one is there already.

        Returns the block now cached at that node (an existing value is never overwritten).
        A block attached elsewhere is detached from its old node first.
        """
        existing = node.blocks.get(window)
        if existing is not None:
            return existing
        if block.node is not None:
            self.detach(block)
        node.blocks[window] = block
        block.node = node
        return block

    def detach(self, block: Block) -> RadixNode | None:
        """Detach `block` from its node and prune nodes left empty. Returns the old node."""
        node = block.node
        if node is None:
            return None
        del node.blocks[block.window]
        block.node = None
        self._prune(node)
        return node

    def _prune(self, node: RadixNode) -> None:
        while node.parent is not None and not node.blocks and not node.children:
            parent = node.parent
            del parent.children[node.key]
            if parent.partial_index is not None:
                bucket_key = partial_index_key(node.key)
                if bucket_key is not None:
                    bucket = parent.partial_index[bucket_key]
                    del bucket[node]
                    if not bucket:
                        del parent.partial_index[bucket_key]
            node.attached = False
            # Break the run links both ways: a live predecessor (always the parent) would
            # keep the pruned node, its successors and their token run alive for good.
            if parent.next_in_run is node:
                parent.next_in_run = None
            node.next_in_run = None
            node.run = None
            self.num_nodes -= 1
            node = parent

    # ------------------------------------------------------------------ block hashes
    def node_hash(self, node: RadixNode) -> bytes | int:
        """Chained block hash of `node` (`hasher.root` for the root), computed once per node,
        iteratively (a deep path never hits the recursion limit)."""
        h = node._hash
        if h is not None:
            return h
        pending = []
        while node._hash is None and node.parent is not None:
            pending.append(node)
            node = node.parent
        h = self.hasher.root if node.parent is None else node._hash
        link = self.hasher.hash
        for n in reversed(pending):
            h = n._hash = link(n.key, h)
        return h

    # ------------------------------------------------------------------ inspection
    def iter_nodes(self) -> Iterator[RadixNode]:
        """Every non-root node, depth first."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def path_keys(self, node: RadixNode) -> list[BlockKey]:
        keys = []
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return keys[::-1]
