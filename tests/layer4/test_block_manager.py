"""BlockManager: allocation, reference counts, copy-on-write, the hash-chained prefix cache,
LRU eviction, truncation (speculative rollback) and its statistics."""
from __future__ import annotations

import pytest

from layer4_algorithms import BlockManager, SamplingParams, Sequence


def seq(tokens, seq_id=0) -> Sequence:
    return Sequence(seq_id, str(seq_id), list(tokens), SamplingParams(max_tokens=4))


def computed(bm: BlockManager, s: Sequence, n: int) -> list[tuple[int, int]]:
    """Allocate and 'compute' the next n tokens of s, as a step would."""
    copies = bm.allocate_slots(s, n)
    assert copies is not None
    s.num_computed_tokens += n
    bm.commit(s)
    return copies


def test_blocks_grow_one_at_a_time_and_return_on_free():
    bm = BlockManager(8, 4)
    s = seq(range(10))
    assert bm.num_new_blocks(s, 10) == 3
    computed(bm, s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert [bm.ref_counts[b] for b in s.block_table] == [1, 1, 1]
    s.token_ids.append(99)
    assert bm.num_new_blocks(s, 1) == 0  # position 10 still fits block 2
    computed(bm, s, 1)
    s.token_ids.append(98)
    assert bm.num_new_blocks(s, 1) == 0 and len(s.block_table) == 3
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 8 and sum(bm.ref_counts) == 0


def test_allocation_fails_cleanly_when_the_pool_is_short():
    bm = BlockManager(2, 4)
    s = seq(range(9))
    assert not bm.can_allocate(s, 9)
    assert bm.allocate_slots(s, 9) is None
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_fork_shares_blocks_and_the_first_write_copies_the_shared_partial_block():
    bm = BlockManager(10, 4)
    parent = seq(range(6))  # one full block + a partial one
    computed(bm, parent, 6)
    child = parent.fork(1, 1, None, None)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [bm.ref_counts[b] for b in parent.block_table] == [2, 2]
    for s in (parent, child):
        s.token_ids.append(50 + s.seq_id)
    shared_partial = parent.block_table[1]
    copies = computed(bm, child, 1)  # the child writes position 6 into the shared block
    assert copies == [(shared_partial, child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != shared_partial
    assert bm.ref_counts[shared_partial] == 1 and bm.ref_counts[parent.block_table[0]] == 2
    assert computed(bm, parent, 1) == []  # the parent is now the sole owner: writes in place
    bm.free(parent)
    bm.free(child)
    assert sum(bm.ref_counts) == 0 and bm.num_free_blocks == 10


def test_prefix_cache_matches_whole_blocks_of_an_equal_prefix_and_never_the_last_token():
    bm = BlockManager(16, 4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0)
    bm.admit(a, bm.match_prefix(a))
    computed(bm, a, 10)
    assert bm.num_cached_blocks == 2  # two full blocks; the partial third is not cached
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43, 44], 1)
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]
    c = seq([1, 2, 3, 4, 5, 6, 7, 8], 2)  # block-aligned: the last block must be recomputed
    assert bm.match_prefix(c) == a.block_table[:1]
    d = seq([9, 2, 3, 4, 5, 6, 7, 8, 1], 3)  # same second block, different first: the chain breaks
    assert bm.match_prefix(d) == []
    bm.admit(b, hits)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert [bm.ref_counts[x] for x in hits] == [2, 2]
    assert bm.stats.queried_tokens == 10 + 11 and bm.stats.hit_tokens == 8
    assert bm.stats.hit_requests == 1 and bm.stats.queried_requests == 2
    assert bm.stats.hit_rate == pytest.approx(8 / 21)


def test_freed_cached_blocks_stay_reusable_until_evicted_tail_first_then_least_recently_used():
    bm = BlockManager(5, 2)
    a, b = seq([1, 2, 3, 4, 5], 0), seq([7, 8, 9], 1)
    computed(bm, a, 5)  # [1 2] [3 4] cached, [5] partial
    computed(bm, b, 3)  # [7 8] cached, [9] partial: the pool is full
    assert bm.num_free_blocks == 0
    a_blocks = list(a.block_table)
    bm.free(a)  # partial blocks go to the free list, cached ones to the LRU list (a's tail first)
    bm.free(b)
    assert bm.num_free_blocks == 5 and bm.num_cached_blocks == 3
    assert bm.match_prefix(seq([1, 2, 3, 4, 6], 2)) == a_blocks[:2]
    computed(bm, seq(range(20, 26), 3), 6)  # 3 blocks: the 2 free ones + the least recently used
    assert bm.match_prefix(seq([1, 2, 3, 4, 6], 4)) == a_blocks[:1]  # a's tail [3 4] went first
    assert len(bm.match_prefix(seq([7, 8, 0], 5))) == 1  # [7 8] survived


def test_a_hit_on_an_idle_cached_block_counts_against_free_space():
    bm = BlockManager(3, 2)
    a = seq([1, 2, 3, 4, 5], 0)
    computed(bm, a, 5)
    bm.free(a)  # [1 2], [3 4] cached and idle, 1 block free
    b = seq([1, 2, 3, 4, 9, 9], 1)
    hits = bm.match_prefix(b)
    assert len(hits) == 2
    assert bm.can_admit(b, hits, 2)  # 2 hits + 1 new block = the whole pool
    assert not bm.can_admit(b, hits, 3)


def test_truncate_frees_trailing_blocks_and_keeps_shared_ones():
    bm = BlockManager(10, 4)
    s = seq(range(6))
    computed(bm, s, 6)
    assert bm.allocate_slots(s, 1 + 5) == []  # a decode plus 5 lookahead slots -> 3 blocks
    assert len(s.block_table) == 3
    s.num_computed_tokens = 7  # one draft accepted: positions 0..6 valid
    bm.truncate(s, 7)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 8
    bm.truncate(s, 7)  # idempotent
    assert len(s.block_table) == 2


def test_reset_prefix_cache_forgets_idle_blocks_only():
    bm = BlockManager(6, 2)
    a, b = seq([1, 2, 3], 0), seq([5, 6, 7], 1)
    computed(bm, a, 3)
    computed(bm, b, 3)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.match_prefix(seq([1, 2, 3], 2)) == [] and len(bm.match_prefix(seq([5, 6, 7], 3))) == 1


def test_disabled_prefix_cache_never_hits():
    bm = BlockManager(6, 2, enable_prefix_caching=False)
    a = seq([1, 2, 3], 0)
    computed(bm, a, 3)
    bm.free(a)
    assert bm.match_prefix(seq([1, 2, 3], 1)) == [] and bm.num_cached_blocks == 0


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def _state(bm: BlockManager) -> tuple:
    """Everything a free changes, read after draining."""
    bm.drain()
    return (list(bm.raw_ref_counts), list(bm._free), list(bm._evictable), dict(bm._cached),
            list(bm._hash_of), bm.num_free_blocks)


@pytest.mark.parametrize("blocks", [9, 24])
@pytest.mark.parametrize("seed", range(6))
def test_parked_frees_leave_what_immediate_frees_leave(seed, blocks):
    """Two pools driven alike, one draining after every free (an immediate free): the same
    block ids are handed out, the same prefix hits found, the same state after, through new
    prompts (fresh, or sharing a prefix with parked ones), decoding, forks and a pool run dry."""
    import random

    rng = random.Random(seed)
    pools = [BlockManager(blocks, 4), BlockManager(blocks, 4)]
    live: list[list[Sequence]] = [[], []]
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    for step in range(200):
        op = rng.random()
        tokens = rng.choice(prefixes)[:rng.randrange(1, 13)] + [
            rng.randrange(50) for _ in range(rng.randrange(0, 9))]
        fork, pick = rng.random() < 0.2, rng.random()
        for bm, seqs, immediate in zip(pools, live, (True, False), strict=True):
            if op < 0.45:  # a new prompt, as the scheduler admits one
                s = seq(tokens, step)
                hits = bm.match_prefix(s)
                n = s.num_tokens - len(hits) * bm.block_size
                if bm.can_admit(s, hits, n):
                    bm.admit(s, hits)
                    assert bm.allocate_slots(s, n) == []
                    s.num_computed_tokens += n
                    bm.commit(s)
                    seqs.append(s)
                    if fork:
                        child = seq(tokens, 1000 + step)
                        bm.fork(s, child)
                        child.num_computed_tokens = s.num_computed_tokens
                        seqs.append(child)
            elif op < 0.75 and seqs:  # a decode step of the oldest
                s = seqs[0]
                s.token_ids.append(7)
                if bm.allocate_slots(s, 1) is not None:
                    s.num_computed_tokens += 1
                    bm.commit(s)
            elif seqs:  # one finishes
                bm.free(seqs.pop(int(pick * len(seqs))))
                if immediate:
                    bm.drain()
        a, b = live
        assert [s.block_table for s in a] == [s.block_table for s in b]
        assert [s.num_computed_tokens for s in a] == [s.num_computed_tokens for s in b]
    assert _state(pools[0]) == _state(pools[1])
    for bm, seqs in zip(pools, live, strict=True):
        for s in seqs:
            bm.free(s)
        assert bm.num_free_blocks == blocks and sum(bm.ref_counts) == 0


def test_a_parked_free_is_seen_by_every_reader_and_drained_once():
    bm = BlockManager(8, 4)
    s = seq(range(10))
    computed(bm, s, 10)
    blocks = list(s.block_table)
    bm.free(s)
    assert s.block_table == [] and s.block_hashes == []
    assert bm.raw_ref_counts[blocks[0]] == 1  # parked: not back yet
    assert bm.num_free_blocks == 8 and sum(bm.ref_counts) == 0  # readers see it back
    bm.drain()  # nothing parked: nothing happens
    assert bm.num_free_blocks == 8 and len(bm._free) + len(bm._evictable) == 8
