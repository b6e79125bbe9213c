"""UnifiedBlockTree: one radix tree shared by all windows (trtllm.md §1.5: auto-prune,
re-attach clears the old slot, attach never overwrites, partial child lookup)."""
from kvjax.ledger.block import PRIMARY, Block
from kvjax.ledger.block_key import SHA256_ROOT_HASH, BlockHasher, BlockKey, MmKey, sha256_block_hash, trtllm64_block_hash
from kvjax.ledger.radix_tree import UnifiedBlockTree

TPB = 4
W, W2 = 64, 8


def blk(i, window=W):
    return Block(i, window, i, PRIMARY)


def K(*tokens, **kw):
    return BlockKey(tuple(tokens), **kw)


def chain(tree, keys, blocks, window=W):
    node = tree.root
    for key, b in zip(keys, blocks, strict=True):
        node = tree.get_or_create_child(node, key)
        tree.attach(node, window, b)
    return node


def test_get_or_create_child_and_hash_chain():
    t = UnifiedBlockTree(TPB)
    n1 = t.get_or_create_child(t.root, K(1, 2, 3, 4))
    assert t.get_or_create_child(t.root, K(1, 2, 3, 4)) is n1  # found, not duplicated
    n2 = t.get_or_create_child(n1, K(5, 6))
    assert t.num_nodes == 2
    assert (n1.depth, n2.depth) == (1, 2)
    assert n1.is_full and not n2.is_full
    assert t.node_hash(t.root) == SHA256_ROOT_HASH  # SHA-256 by default
    assert t.node_hash(n1) == sha256_block_hash(K(1, 2, 3, 4), SHA256_ROOT_HASH)
    assert t.node_hash(n2) == sha256_block_hash(K(5, 6), t.node_hash(n1))  # h_i = H(key_i, h_{i-1})
    t64 = UnifiedBlockTree(TPB, BlockHasher("trtllm64"))
    m1 = t64.get_or_create_child(t64.root, K(1, 2, 3, 4))
    m2 = t64.get_or_create_child(m1, K(5, 6))
    assert t64.node_hash(t64.root) == 0
    assert t64.node_hash(m2) == trtllm64_block_hash(K(5, 6), trtllm64_block_hash(K(1, 2, 3, 4), 0))
    assert t.path_keys(n2) == [K(1, 2, 3, 4), K(5, 6)]
    assert t.child(t.root, K(1, 2, 3, 4)) is n1 and t.child(t.root, K(1, 2, 3, 5)) is None


def test_attach_detach_and_prune_to_root():
    t = UnifiedBlockTree(TPB)
    b0, b1, b2 = blk(0), blk(1), blk(2)
    leaf = chain(t, [K(1, 2, 3, 4), K(5, 6, 7, 8), K(9)], [b0, b1, b2])
    assert b2.node is leaf and leaf.blocks == {W: b2}
    assert b0.is_cached and b0.key == K(1, 2, 3, 4) and b0.node is leaf.parent.parent
    # detaching a value that still has children does not prune
    t.detach(b1)
    assert b1.node is None and t.num_nodes == 3
    assert leaf.attached and leaf.parent.attached and leaf.parent.blocks == {}
    # detaching the last leaf prunes every empty node up to the first one holding a block
    t.detach(b2)
    assert not leaf.attached and t.num_nodes == 1
    assert list(t.root.children.values()) == [b0.node]
    t.detach(b0)
    assert t.num_nodes == 0 and t.root.children == {} and not t.root.partial_index
    assert t.detach(b0) is None  # detaching an uncached block is a no-op


def test_node_with_another_window_is_not_pruned():
    t = UnifiedBlockTree(TPB)
    node = t.get_or_create_child(t.root, K(1, 2, 3, 4))
    a, b = blk(0, W), blk(0, W2)
    t.attach(node, W, a)
    t.attach(node, W2, b)
    t.detach(a)
    assert node.attached and node.blocks == {W2: b}
    t.detach(b)
    assert not node.attached and t.num_nodes == 0


def test_attach_is_idempotent_and_never_overwrites():
    t = UnifiedBlockTree(TPB)
    node = t.get_or_create_child(t.root, K(1, 2, 3, 4))
    first, dup = blk(0), blk(1)
    assert t.attach(node, W, first) is first
    assert t.attach(node, W, first) is first
    assert t.attach(node, W, dup) is first  # existing (key, window) value kept
    assert dup.node is None and node.blocks[W] is first


def test_reattach_clears_old_slot():
    t = UnifiedBlockTree(TPB)
    b = blk(0)
    partial = t.get_or_create_child(t.root, K(1, 2))
    t.attach(partial, W, b)
    full = t.get_or_create_child(t.root, K(1, 2, 3, 4))
    t.attach(full, W, b)  # the block grew: stored again under its full key
    assert b.node is full and full.blocks == {W: b}
    assert not partial.attached and t.num_nodes == 1  # old slot cleared and pruned


def test_best_partial_child_picks_longest_match_oldest_on_ties():
    t = UnifiedBlockTree(TPB)
    b0, b1, b2, b3 = blk(0), blk(1), blk(2), blk(3)
    chain(t, [K(1, 2, 3, 4)], [b0])
    chain(t, [K(1, 2, 9, 9)], [b1])
    chain(t, [K(1, 2, 3, 8)], [b2])
    chain(t, [K(1, 2, 3, 7)], [b3])
    node, n = t.best_partial_child(t.root, K(1, 2, 3, 5), W, skip_referenced=False)
    assert (node.blocks[W], n) == (b0, 3)  # b0, b2, b3 tie at 3: the oldest child wins
    node, n = t.best_partial_child(t.root, K(1, 2, 9, 5), W, skip_referenced=False)
    assert (node.blocks[W], n) == (b1, 3)
    node, n = t.best_partial_child(t.root, K(1, 5), W, skip_referenced=False)
    assert n == 1 and node.blocks[W] is b0
    assert t.best_partial_child(t.root, K(2, 2, 3, 4), W, False) == (None, 0)  # first token differs
    assert t.best_partial_child(t.root, K(1, 2, 3, 5), W2, False) == (None, 0)  # no block of that window


def test_best_partial_child_skips_referenced_when_asked():
    t = UnifiedBlockTree(TPB)
    b0, b1 = blk(0), blk(1)
    chain(t, [K(1, 2, 3, 4)], [b0])
    chain(t, [K(1, 2, 8, 8)], [b1])
    b0.ref_count = 1
    node, n = t.best_partial_child(t.root, K(1, 2, 3, 5), W, skip_referenced=False)
    assert (node.blocks[W], n) == (b0, 3)
    node, n = t.best_partial_child(t.root, K(1, 2, 3, 5), W, skip_referenced=True)
    assert (node.blocks[W], n) == (b1, 2)  # the referenced best candidate is skipped


def test_best_partial_child_respects_constraints_and_mm():
    t = UnifiedBlockTree(TPB)
    chain(t, [K(1, 2, 3, 4, lora_task_id=1)], [blk(0)])
    chain(t, [K(1, 2, 3, 4, extra_ids=(0, 0, 0, 0))], [blk(1)])
    chain(t, [K(1, 2, 3, 4, mm_keys=(MmKey(b"h", 0),))], [blk(2)])
    assert t.best_partial_child(t.root, K(1, 2, 3, 5), W, False) == (None, 0)  # no plain child
    node, n = t.best_partial_child(t.root, K(1, 2, 3, 5, lora_task_id=1), W, False)
    assert n == 3 and node.blocks[W].block_id == 0
    node, n = t.best_partial_child(t.root, K(1, 2, 3, 5, extra_ids=(0, 0, 0, 0)), W, False)
    assert n == 3 and node.blocks[W].block_id == 1
    node, n = t.best_partial_child(t.root, K(1, 2, 3, 4, extra_ids=(0, 1, 0, 0)), W, False)
    assert n == 1 and node.blocks[W].block_id == 1  # extra id differs at position 1
    # keys with multimodal extra keys never partially match (either side)
    assert t.best_partial_child(t.root, K(1, 2, 3, 5, mm_keys=(MmKey(b"h", 0),)), W, False) == (None, 0)


def test_partial_index_follows_pruning():
    t = UnifiedBlockTree(TPB)
    b0 = blk(0)
    chain(t, [K(1, 2, 3, 4)], [b0])
    assert t.best_partial_child(t.root, K(1, 9), W, False)[1] == 1
    t.detach(b0)
    assert t.root.partial_index == {}  # built by the lookup above, then kept in step
    assert t.best_partial_child(t.root, K(1, 9), W, False) == (None, 0)


def test_iter_nodes_visits_every_node():
    t = UnifiedBlockTree(TPB)
    chain(t, [K(1, 2, 3, 4), K(5, 6, 7, 8)], [blk(0), blk(1)])
    chain(t, [K(1, 2, 3, 4), K(5, 6, 7, 9)], [blk(0), blk(2)])  # shares the first node
    chain(t, [K(7)], [blk(3)])
    assert t.num_nodes == 4
    assert sorted(n.key.tokens for n in t.iter_nodes()) == [(1, 2, 3, 4), (5, 6, 7, 8), (5, 6, 7, 9), (7,)]


def test_new_leaves_start_without_children():
    # leaves may share an empty child map internally; growing one node must not leak children
    t = UnifiedBlockTree(TPB)
    a = t.get_or_create_child(t.root, K(1, 2, 3, 4))
    t.get_or_create_child(a, K(5, 6, 7, 8))
    b = t.get_or_create_child(t.root, K(9, 9, 9, 9))
    c = t.get_or_create_child(a, K(5, 6, 7, 9))
    for leaf in (b, c):
        assert leaf.children == {} and not leaf.partial_index  # built lazily, on a partial lookup
    assert len(a.children) == 2 and len(t.root.children) == 2
    assert t.best_partial_child(b, K(5, 6), W, False) == (None, 0)
