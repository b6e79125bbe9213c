"""RadixTree: one radix tree shared by all windows, with compressed runs (TensorRT-LLM's lookup tree:
auto-prune, re-attach clears the old slot, attach never overwrites, partial child lookup;
SGLang: a stored run is one node until a path diverges from it)."""
import array
import random

from kvjax.ledger.block_hashing import SHA256_ROOT_HASH, BlockHasher, sha256_block_hash, trtllm64_block_hash
from kvjax.ledger.block_key import BlockKey, MmKey
from kvjax.ledger.radix_tree import NO_BLOCK, ROOT, RadixTree
from kvjax.ledger.token_path import PLAIN_SIGNATURE, TokenPath, encode_tokens, encode_with_extra

TPB = 4
W, W2 = 0, 1  # window indices


def tree(windows=1, blocks=64, hasher=None):
    return RadixTree(TPB, [blocks] * windows, hasher)


def path(tokens, signature=PLAIN_SIGNATURE, extra=None, mm=None):
    content = encode_tokens(tokens) if extra is None else encode_with_extra(tokens, extra)
    return TokenPath(content, 0, signature, TPB, len(tokens), mm)


def store(t, tokens, blocks, w=W, partial=False, **kw):
    """Attach `blocks` along `tokens` (the last block partial when `partial`); returns moves."""
    p = path(tokens, **kw)
    n_full = len(tokens) // TPB
    moves = []
    t.insert(w, p, (ROOT, -1), n_full + int(partial), n_full, array.array("i", blocks), lambda d, b: moves.append((d, b)))
    return moves


def partial(t, after_block, query, w=W, skip=False, ref=None, signature=PLAIN_SIGNATURE, mm=(), extra=None):
    after = (ROOT, -1) if after_block is None else t.position_of(w, after_block)
    q = encode_tokens(query) if extra is None else encode_with_extra(query, extra)
    return t.best_partial(w, after, q, signature, mm, ref or array.array("i", [0]) * 64, skip)


def test_hash_chain_and_keys():
    t = tree()
    store(t, [1, 2, 3, 4, 5, 6], [0, 1], partial=True)
    n0, n1 = t.position_of(W, 0), t.position_of(W, 1)
    assert t.position_hash(ROOT, -1) == SHA256_ROOT_HASH  # SHA-256 by default
    assert t.position_hash(*n0) == sha256_block_hash(BlockKey((1, 2, 3, 4)), SHA256_ROOT_HASH)
    assert t.position_hash(*n1) == sha256_block_hash(BlockKey((5, 6)), t.position_hash(*n0))  # h_i = H(key_i, h_{i-1})
    assert t.path_keys(*n1) == [BlockKey((1, 2, 3, 4)), BlockKey((5, 6))]
    assert t.key_at(*n1) == BlockKey((5, 6)) and t.position_tokens(*n1) == 2
    t64 = tree(hasher=BlockHasher("trtllm64"))
    store(t64, [1, 2, 3, 4, 5, 6], [0, 1], partial=True)
    assert t64.position_hash(ROOT, -1) == 0
    want = trtllm64_block_hash(BlockKey((5, 6)), trtllm64_block_hash(BlockKey((1, 2, 3, 4)), 0))
    assert t64.position_hash(*t64.position_of(W, 1)) == want


def test_a_stored_run_is_one_node_until_a_path_diverges():
    t = tree()
    store(t, list(range(16)), [0, 1, 2, 3])
    assert (t.num_nodes, t.num_positions) == (1, 4)
    head = t.position_of(W, 0)[0]
    # a second path shares two blocks, then diverges: the run splits there
    store(t, list(range(8)) + [99] * 8, [10, 11, 12, 13])
    assert (t.num_nodes, t.num_positions) == (3, 6)
    assert t.position_of(W, 0)[0] == t.position_of(W, 1)[0] != head  # the shared head moved
    assert t.position_of(W, 2) == (head, 0) and t.position_of(W, 3) == (head, 1)  # the tail kept its node
    assert t.position_of(W, 10) is None and t.position_of(W, 11) is None  # duplicates stay private
    assert t.position_of(W, 12)[0] == t.position_of(W, 13)[0]  # the new branch is one node
    assert t.path_keys(*t.position_of(W, 3))[-1] == BlockKey(tuple(range(12, 16)))
    assert t.path_keys(*t.position_of(W, 13)) == [BlockKey(tuple(range(i, i + 4))) for i in (0, 4)] + [BlockKey((99,) * 4)] * 2
    assert t.depth[t.position_of(W, 12)[0]] == 2 and t.parent[head] == t.position_of(W, 1)[0]
    # position ids survive the split: a cursor found before it still finds its position
    pid2 = t.pid[head]
    assert t.locate(head, pid2) == (head, 0)
    pid1 = t.pid[t.position_of(W, 1)[0]] + 1
    assert t.locate(head, pid1) == t.position_of(W, 1)  # found by walking up from the old node


def store_from(t, tokens, blocks, after, w=W):
    """Store the full blocks of `tokens` past depth `len(path) - len(blocks)`, resuming after
    position `after` (what a sequence's storing cursor does); returns the cursor."""
    n_full = len(tokens) // TPB
    base = n_full - len(blocks)
    content = encode_tokens(tokens[base * TPB :])
    p = TokenPath(content, base, PLAIN_SIGNATURE, TPB, len(tokens), None)
    row = array.array("i", [NO_BLOCK] * base + blocks)
    return t.insert(w, p, after, n_full, n_full, row, lambda d, b: None)[1]


def test_a_leaf_run_grows_in_place_as_its_path_goes_on():
    t = tree()
    toks = list(range(100, 140))
    cur = store_from(t, toks[:8], [0, 1], (ROOT, -1))
    node = t.position_of(W, 0)[0]
    for d in range(2, 10):  # a decode stores one block at a time, resuming at its cursor
        cur = store_from(t, toks[: (d + 1) * TPB], [d], t.locate(*cur))
        assert t.position_of(W, d) == (node, d) and cur == (node, t.pid[node] + d)
    assert (t.num_nodes, t.num_positions) == (1, 10)
    assert t.path_keys(node, 9)[-1] == BlockKey(tuple(toks[36:40]))
    # another path diverging inside the grown run splits it as usual
    store(t, toks[:20] + [7] * 4, [20, 21, 22, 23, 24, 25])
    assert t.num_nodes == 3 and t.position_of(W, 25)[0] != node


def test_a_run_that_lost_its_tail_never_grows_again():
    """Position ids are never handed out twice: once a leaf loses its last position, the
    next block after it gets a node of its own, and a cursor naming the dropped position
    finds nothing."""
    t = tree()
    store(t, list(range(16)), [0, 1, 2, 3])
    node = t.position_of(W, 3)[0]
    dropped = t.pid[node] + 3
    t.detach(W, 3)  # evicted from the tail
    assert t.length[node] == 3
    store_from(t, list(range(12)) + [9] * 4, [5], t.position_of(W, 2))
    assert t.position_of(W, 5)[0] != node and t.num_nodes == 2
    assert t.locate(node, dropped) is None
    assert t.pid[t.position_of(W, 5)[0]] != dropped


def test_a_run_stops_growing_at_the_run_limit():
    from kvjax.ledger.radix_tree import RUN_LIMIT

    t = RadixTree(TPB, [2 * RUN_LIMIT + 8])
    toks = [i % 1000 for i in range((RUN_LIMIT + 2) * TPB)]
    cur = store_from(t, toks[:TPB], [0], (ROOT, -1))
    for d in range(1, RUN_LIMIT + 2):
        cur = store_from(t, toks[: (d + 1) * TPB], [d], t.locate(*cur))
    first = t.position_of(W, 0)[0]
    assert t.length[first] == RUN_LIMIT and t.num_nodes == 2
    assert t.position_of(W, RUN_LIMIT) == (t.position_of(W, RUN_LIMIT + 1)[0], 0)


def test_detach_prunes_trailing_positions_up_to_the_root():
    t = tree()
    store(t, list(range(12)), [0, 1, 2])
    assert t.detach(W, 1) and t.num_positions == 3  # a hole with a block after it stays
    assert t.value(W, *t.position_of(W, 0)) == 0 and t.position_of(W, 1) is None
    t.detach(W, 2)  # the last position goes, and so does the hole before it
    assert (t.num_nodes, t.num_positions) == (1, 1)
    t.detach(W, 0)
    assert (t.num_nodes, t.num_positions) == (0, 0) and t.children[ROOT] is None
    assert not t.detach(W, 0)  # detaching an uncached block is a no-op
    assert t.free_ids == [1] and t.content[1] is None  # the freed node keeps nothing


def test_position_with_another_window_is_not_pruned():
    t = tree(windows=2)
    store(t, [1, 2, 3, 4], [0], w=W)
    store(t, [1, 2, 3, 4], [5], w=W2)
    assert t.position_of(W, 0) == t.position_of(W2, 5)  # one position, a block per window
    t.detach(W, 0)
    assert t.num_positions == 1 and t.value(W2, *t.position_of(W2, 5)) == 5
    t.detach(W2, 5)
    assert t.num_nodes == 0


def test_insert_never_overwrites_and_skips_placeholders():
    t = tree()
    store(t, [1, 2, 3, 4, 5, 6, 7, 8], [0, 1])
    store(t, [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], [2, -5, 3])
    assert t.position_of(W, 2) is None  # the position holds block 0 already
    assert t.value(W, *t.position_of(W, 1)) == 1 and t.position_of(W, 3) is not None
    t2 = tree()
    store(t2, [1, 2, 3, 4, 5, 6, 7, 8], [-5, -5])  # placeholders only: nothing stays
    assert t2.num_positions == 0 and t2.num_nodes == 0


def test_a_partial_block_that_grew_moves_to_its_full_key():
    t = tree()
    assert store(t, [1, 2, 3, 4, 5, 6], [0, 1], partial=True) == []
    partial_pos = t.position_of(W, 1)
    assert store(t, [1, 2, 3, 4, 5, 6, 7, 8], [0, 1]) == [(1, 1)]  # reported before it moves
    full_pos = t.position_of(W, 1)
    assert full_pos != partial_pos and t.key_at(*full_pos) == BlockKey((5, 6, 7, 8))
    assert t.num_positions == 2  # the partial position was pruned


def test_best_partial_picks_longest_match_oldest_on_ties():
    t = tree()
    store(t, [1, 2, 3, 4], [0])
    store(t, [1, 2, 9, 9], [1])
    store(t, [1, 2, 3, 8], [2])
    store(t, [1, 2, 3, 7], [3])
    assert partial(t, None, [1, 2, 3, 5]) == (0, 3)  # 0, 2, 3 tie at 3: the oldest wins
    assert partial(t, None, [1, 2, 9, 5]) == (1, 3)
    assert partial(t, None, [1, 5]) == (0, 1)
    assert partial(t, None, [2, 2, 3, 4]) == (NO_BLOCK, 0)  # first token differs
    assert partial(t, None, [1, 2, 3, 4]) == (0, 4)  # an exact match of the whole block
    t2 = tree(windows=2)
    store(t2, [1, 2, 3, 4], [0])
    assert partial(t2, None, [1, 2, 3, 5], w=W2) == (NO_BLOCK, 0)  # no block of that window


def test_best_partial_inside_a_run_has_one_candidate():
    t = tree()
    store(t, [1, 2, 3, 4, 5, 6, 7, 8], [0, 1])
    assert partial(t, 0, [5, 6, 9, 9]) == (1, 2)
    assert partial(t, 0, [6]) == (NO_BLOCK, 0)
    ref = array.array("i", [0]) * 64
    ref[1] = 1
    assert partial(t, 0, [5, 6], skip=True, ref=ref) == (NO_BLOCK, 0)


def test_best_partial_skips_referenced_when_asked():
    t = tree()
    store(t, [1, 2, 3, 4], [0])
    store(t, [1, 2, 8, 8], [1])
    ref = array.array("i", [0]) * 64
    ref[0] = 1
    assert partial(t, None, [1, 2, 3, 5], ref=ref) == (0, 3)
    assert partial(t, None, [1, 2, 3, 5], skip=True, ref=ref) == (1, 2)  # the referenced best is skipped


def test_best_partial_respects_constraints_and_mm():
    t = tree()
    lora = (False, 1, None)
    extra = (True, None, None)
    store(t, [1, 2, 3, 4], [0], signature=lora)
    store(t, [1, 2, 3, 4], [1], signature=extra, extra=[0, 0, 0, 0])
    store(t, [1, 2, 3, 4], [2], mm={0: (MmKey(b"h", 0),)})
    assert partial(t, None, [1, 2, 3, 5]) == (NO_BLOCK, 0)  # no plain child
    assert partial(t, None, [1, 2, 3, 5], signature=lora) == (0, 3)
    assert partial(t, None, [1, 2, 3, 5], signature=extra, extra=[0, 0, 0, 0]) == (1, 3)
    assert partial(t, None, [1, 2, 3, 4], signature=extra, extra=[0, 1, 0, 0]) == (1, 1)  # extra id differs at 1
    # keys with multimodal extra keys never partially match (either side)
    assert partial(t, None, [1, 2, 3, 5], mm=(MmKey(b"h", 0),)) == (NO_BLOCK, 0)
    assert t.key_at(*t.position_of(W, 1)) == BlockKey((1, 2, 3, 4), (0, 0, 0, 0))
    assert t.key_at(*t.position_of(W, 2)).mm_keys == (MmKey(b"h", 0),)


def test_partial_index_follows_pruning_and_splits():
    t = tree()
    store(t, [1, 2, 3, 4], [0])
    assert partial(t, None, [1, 9]) == (0, 1)
    assert {s: f.live() for s, f in t.pindex[ROOT].items()} == {0: [encode_tokens([1, 2, 3, 4])]}  # built by the lookup
    t.detach(W, 0)
    assert t.pindex[ROOT] == {} and partial(t, None, [1, 9]) == (NO_BLOCK, 0)
    store(t, [5, 6, 7, 8, 1, 1, 1, 1], [1, 2])
    store(t, [5, 6, 7, 8, 2, 2, 2, 2], [3, 4])  # splits the first run
    assert partial(t, None, [5, 6, 0]) == (1, 2)
    assert partial(t, 1, [1, 2, 2, 2]) == (2, 1) and partial(t, 1, [2, 2]) == (4, 2)


def test_best_partial_agrees_with_a_scan_over_many_siblings():
    """The sorted index (two binary searches) against the definition: longest common prefix
    over the children holding a block, oldest first on ties."""
    rng = random.Random(3)
    t = tree(blocks=4000)
    order = []
    for b in range(3000):
        toks = [7] + [rng.randrange(4) for _ in range(3)]
        if store(t, toks, [b]) == [] and t.position_of(W, b) is not None:
            order.append((b, toks))
    ref = array.array("i", [rng.randrange(2) for _ in range(4000)])
    for _ in range(300):
        q = [7] + [rng.randrange(4) for _ in range(rng.randrange(4))]
        for skip in (False, True):
            best, best_n = NO_BLOCK, 0
            for b, toks in order:  # oldest first
                if skip and ref[b]:
                    continue
                n = next((i for i in range(len(q)) if q[i] != toks[i]), len(q))
                if n > best_n:
                    best, best_n = b, n
            assert partial(t, None, q, skip=skip, ref=ref) == (best, best_n), (q, skip)


def test_partial_index_survives_removals_and_returns():
    """Removed siblings only leave dead marks in the sorted index until they are half of it;
    lookups, re-added keys and the index's compaction must agree with a scan throughout."""
    rng = random.Random(5)
    t = tree(blocks=600)
    live: dict[int, list[int]] = {}  # block -> its one-block path, in storing order
    partial(t, None, [7])  # builds the root's index now, so every change below goes through it

    def check():
        for q in ([7], [7, 1], [7, 2, 3], [7, 0, 0, 0], [8, 1]):
            best, best_n = NO_BLOCK, 0
            for b, toks in sorted(live.items(), key=lambda bt: t.pid[t.position_of(W, bt[0])[0]]):
                n = next((i for i in range(len(q)) if q[i] != toks[i]), len(q))
                if n > best_n:
                    best, best_n = b, n
            assert partial(t, None, q) == (best, best_n), q
        firsts = t.pindex[ROOT].get(0)
        assert (firsts.live() if firsts else []) == sorted(encode_tokens(toks) for toks in live.values())

    next_block = 0
    for step in range(1500):
        if live and rng.random() < 0.5:
            b = rng.choice(list(live))
            t.detach(W, b)
            del live[b]
        else:
            toks = [7] + [rng.randrange(3) for _ in range(3)]
            if any(v == toks for v in live.values()):
                continue
            b = next_block % 600
            while b in live:
                b = (b + 1) % 600
            next_block = b + 1
            store(t, toks, [b])
            live[b] = toks
        if step % 50 == 0:
            check()
    check()


def test_best_partial_over_mixed_length_siblings_agrees_with_a_scan():
    """Siblings whose first block is full or partial (shorter keys), zero tokens (a short key
    is a byte prefix of a longer one), many ties on the shared first token and removals: the
    neighbour test, the bounded searches and the age-order path against the definition."""
    rng = random.Random(11)
    t = tree(blocks=3000)
    live: dict[int, list[int]] = {}
    partial(t, None, [7])  # builds the root's index now, so every change below goes through it
    alphabet = [0, 1, 2, 300, 70000]

    def check(queries):
        ref = array.array("i", [rng.randrange(3) == 0 for _ in range(3000)])
        order = sorted(live.items(), key=lambda bt: t.pid[t.position_of(W, bt[0])[0]])
        for q in queries:
            for skip in (False, True):
                best, best_n = NO_BLOCK, 0
                for b, toks in order:
                    if skip and ref[b]:
                        continue
                    n = next((i for i in range(min(len(q), len(toks))) if q[i] != toks[i]), min(len(q), len(toks)))
                    if n > best_n:
                        best, best_n = b, n
                assert partial(t, None, q, skip=skip, ref=ref) == (best, best_n), (q, skip)
        firsts = t.pindex[ROOT].get(0)
        assert firsts is None or len(firsts.ages) - firsts.head <= 2 * len(live) + 1  # stale ones compacted

    free = list(range(3000))
    rng.shuffle(free)
    for step in range(2500):
        if live and rng.random() < 0.3:
            b = rng.choice(list(live))
            t.detach(W, b)
            del live[b]
            free.append(b)
            continue
        first = 7 if rng.random() < 0.9 else rng.choice(alphabet)
        toks = [first] + [rng.choice(alphabet) for _ in range(rng.choice((0, 1, 2, 3, 3, 3)))]
        if any(v == toks for v in live.values()):
            continue
        b = free.pop()
        moves = store(t, toks, [b], partial=len(toks) < TPB)
        assert moves == [] and t.position_of(W, b) is not None
        live[b] = toks
        if step % 250 == 0:
            check([[7] + [rng.choice(alphabet) for _ in range(rng.randrange(4))] for _ in range(30)] + [[0], [7, 0], [300]])
    check([[7] + [rng.choice(alphabet) for _ in range(rng.randrange(4))] for _ in range(60)])
    firsts = t.pindex[ROOT].get(0)
    assert firsts.live() == sorted(encode_tokens(toks) for toks in live.values())


def test_partial_ties_stay_cheap_and_exact_under_lru_churn():
    """Eviction removes the oldest children first while new ones arrive: ties among many
    siblings (a shared first token) are settled from the index's age list, whose stale front
    is dropped as lookups meet it and which is compacted once half stale, so it stays within
    twice the live children; picks agree with a scan throughout (keys also come back)."""
    rng = random.Random(17)
    t = tree(blocks=400)
    order: list[int] = []  # blocks, oldest first
    toks_of: dict[int, list[int]] = {}
    for b in range(300):
        toks = [7] + [rng.randrange(6) for _ in range(3)]
        if toks in toks_of.values():
            continue
        store(t, toks, [b])
        order.append(b)
        toks_of[b] = toks
    partial(t, None, [7])  # builds the root's index
    free = [b for b in range(400) if b not in toks_of]
    for step in range(1500):
        b = order.pop(0)  # the oldest goes
        t.detach(W, b)
        del toks_of[b]
        free.append(b)
        while True:  # a new child arrives (its key may be one removed before)
            toks = [7] + [rng.randrange(6) for _ in range(3)]
            if toks not in toks_of.values():
                break
        b = free.pop(0)
        store(t, toks, [b])
        order.append(b)
        toks_of[b] = toks
        if step % 3 == 0:
            q = [7] + [rng.randrange(6) for _ in range(rng.randrange(3))]
            best, best_n = NO_BLOCK, 0
            for ob in order:
                n = next((i for i in range(len(q)) if q[i] != toks_of[ob][i]), len(q))
                if n > best_n:
                    best, best_n = ob, n
            assert partial(t, None, q) == (best, best_n), q
        firsts = t.pindex[ROOT][0]
        assert len(firsts.ages) <= 4 * len(order) + 2  # bounded by the live children, not by time
        live = [a for j, a in enumerate(firsts.ages) if j >= firsts.head and t.children[ROOT].get(a) is not None
                and t.pid[t.children[ROOT][a]] == firsts.births[j]]
        assert live == [encode_tokens(toks_of[ob]) for ob in order]
