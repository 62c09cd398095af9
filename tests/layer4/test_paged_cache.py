"""PagedKVCache: slot mapping, write/read against layer 3's contiguous cache, decode attention
against a per-sequence softmax reference, copy-on-write copies and budget sizing."""
from __future__ import annotations

import math

import pytest
import torch

import layer3_model as l3
from layer4_algorithms import (
    PagedKVCache,
    blocks_for_budget,
    bytes_per_block,
    paged_decode_attention_reference,
)

L, HKV, D = 2, 2, 8


def filled_caches(seq_lens, block_size, seed=0):
    """The same keys/values written into a paged cache (shuffled, non-contiguous blocks) and
    into layer 3's contiguous cache, as one prefill step."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    ids = torch.randperm(sum(need) + 3, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    paged = PagedKVCache(L, sum(need) + 3, block_size, HKV, D)
    cont = l3.ContiguousKVCache(L, len(seq_lens), max(seq_lens), HKV, D)
    T = sum(seq_lens)
    ctx_p = paged.context(seq_lens, [0] * len(seq_lens), tables)
    ctx_c = cont.context(seq_lens, [0] * len(seq_lens))
    for layer in range(L):
        k, v = torch.randn(T, HKV, D, generator=g), torch.randn(T, HKV, D, generator=g)
        paged.write(layer, k, v, ctx_p)
        cont.write(layer, k, v, ctx_c)
    return paged, cont, tables


def test_slot_mapping_follows_the_block_table():
    cache = PagedKVCache(1, 8, 4, 1, 2)
    ctx = cache.context([3, 1], [5, 2], [[6, 2], [1]])
    # seq 0: positions 5,6,7 -> block 2 (second entry), slots 1..3;
    # seq 1: position 2 -> block 1, slot 2
    assert ctx.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 1 * 4 + 2]
    assert ctx.block_tables.tolist() == [[6, 2], [1, 0]]  # padded with 0
    assert ctx.positions.tolist() == [5, 6, 7, 2] and ctx.seq_lens.tolist() == [8, 3]
    with pytest.raises(ValueError, match="cannot hold"):
        cache.context([4], [5], [[1, 2]])


def test_context_of_ragged_random_tables_matches_a_per_token_lookup():
    gen = torch.Generator().manual_seed(7)
    for _ in range(20):
        bs = int(torch.randint(1, 6, (1,), generator=gen))
        B = int(torch.randint(1, 9, (1,), generator=gen))
        q = torch.randint(1, 7, (B,), generator=gen).tolist()
        c = torch.randint(0, 20, (B,), generator=gen).tolist()
        tables = []
        for qi, ci in zip(q, c, strict=True):
            extra = int(torch.randint(0, 3, (1,), generator=gen))  # drawn first, as before
            size = -(-(qi + ci) // bs) + extra
            tables.append(torch.randint(0, 50, (size,), generator=gen).tolist())
        ctx = PagedKVCache(1, 64, bs, 1, 2).context(q, c, tables)
        width = max(len(t) for t in tables)
        assert ctx.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
        want = [t[p // bs] * bs + p % bs for t, qi,
                ci in zip(tables, q, c, strict=True) for p in range(ci, ci + qi)]
        assert ctx.slot_mapping.tolist() == want
        assert ctx.positions.tolist() == [p for qi,
                                          ci in zip(q, c, strict=True) for p in range(ci, ci + qi)]
        assert ctx.seq_lens.tolist() == [qi + ci for qi, ci in zip(q, c, strict=True)]
        assert ctx.query_start_loc.tolist() == [sum(q[:b]) for b in range(B + 1)]


def test_a_decode_steps_context_is_what_the_general_build_makes():
    """A decode step's context (one token a sequence: the cache writes its index arrays
    straight into one host array) equals layer 3's AttentionContext.build of the same step,
    field by field, with the table given padded (the runner's mirror) or as lists."""
    import numpy as np  # noqa: PLC0415

    gen = torch.Generator().manual_seed(11)
    for B in (1, 2, 5, 9):
        bs = int(torch.randint(1, 6, (1,), generator=gen))
        c = torch.randint(0, 30, (B,), generator=gen).tolist()
        tables = [torch.randint(0, 50, (c_ // bs + 1 + int(torch.randint(0, 2, (1,),
                                                                        generator=gen)),),
                                generator=gen).tolist() for c_ in c]
        width = max(map(len, tables))
        padded = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64)
        lens = np.array([len(t) for t in tables], dtype=np.int64)
        cache = PagedKVCache(1, 64, bs, 1, 2)
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, c, strict=True)]
        want = l3.AttentionContext.build([1] * B, c, slots, block_tables=padded)
        for got in (cache.context(np.ones(B, dtype=np.int64), np.array(c), padded,
                                  table=(padded, lens)),
                    cache.context([1] * B, c, tables)):
            for name in ("positions", "slot_mapping", "seq_ids", "query_offsets",
                         "query_start_loc", "query_lens", "seq_lens", "block_tables"):
                a, b = getattr(got, name), getattr(want, name)
                assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
            for name in ("max_query_len", "max_seq_len", "query_lens_host", "seq_lens_host"):
                assert getattr(got, name) == getattr(want, name), name
    with pytest.raises(ValueError, match="cannot hold"):
        PagedKVCache(1, 8, 4, 1, 2).context([1], [4], [[1]])


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_read_gathers_what_the_contiguous_cache_reads(block_size):
    seq_lens = [5, 12, 1, 9]
    paged, cont, tables = filled_caches(seq_lens, block_size)
    ctx_p = paged.context([1] * 4, [n - 1 for n in seq_lens], tables)
    ctx_c = cont.context([1] * 4, [n - 1 for n in seq_lens])
    for layer in range(L):
        (kp, vp), (kc, vc) = paged.read(layer, ctx_p), cont.read(layer, ctx_c)
        assert kp.shape == kc.shape == (4, HKV, max(seq_lens), D)
        for b, n in enumerate(seq_lens):
            assert torch.equal(kp[b, :, :n],
                               kc[b, :, :n]) and torch.equal(vp[b, :, :n], vc[b, :, :n])


def reference_decode(q, k, v, seq_lens, scale, window=None):
    """Loop over sequences and heads: softmax(q k^T * scale) v over the visible keys."""
    B, Hq, _ = q.shape
    G = Hq // k.shape[1]
    out = torch.empty_like(q)
    for b, n in enumerate(seq_lens):
        lo = 0 if window is None else max(0, n - window)
        for h in range(Hq):
            keys, vals = k[b, h // G, lo:n], v[b, h // G, lo:n]
            out[b, h] = torch.softmax(keys @ q[b, h] * scale, dim=0) @ vals
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_decode_attention_matches_a_per_sequence_softmax(window):
    seq_lens = [5, 12, 1, 9]
    paged, cont, tables = filled_caches(seq_lens, 4, seed=1)
    q = torch.randn(4, 2 * HKV, D, generator=torch.Generator().manual_seed(2))
    ctx = paged.context([1] * 4, [n - 1 for n in seq_lens], tables)
    scale = 1 / math.sqrt(D)
    k, v = cont.read(0, cont.context([1] * 4, [n - 1 for n in seq_lens]))
    want = reference_decode(q, k, v, seq_lens, scale, window)
    torch.testing.assert_close(paged.decode_attention(0, q, ctx, scale, window), want, atol=1e-5,
                               rtol=1e-5)
    got = paged_decode_attention_reference(q, paged.k[0], paged.v[0], ctx.block_tables,
                                           ctx.seq_lens, scale, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_copy_blocks_copies_every_layer_k_and_v():
    paged, _, tables = filled_caches([6], 4)
    src, dst = tables[0][1], next(b for b in range(paged.num_blocks) if b not in tables[0])
    paged.copy_blocks([(src, dst)])
    assert torch.equal(paged.k[:, dst],
                       paged.k[:, src]) and torch.equal(paged.v[:, dst], paged.v[:, src])
    paged.copy_blocks([])  # nothing to do


def test_scratch_block_is_past_the_managed_ones():
    cache = PagedKVCache(1, 5, 4, 1, 2)
    assert cache.scratch_block == 5 and cache.k.shape[1] == 6 and cache.block_size == 4


def test_budget_sizing():
    cfg = l3.ModelConfig.from_dict(dict(model_type="llama", vocab_size=10, hidden_size=16,
                                        intermediate_size=32,
                                        num_hidden_layers=3, num_attention_heads=2,
                                        num_key_value_heads=1,
                                        head_dim=8))
    per = bytes_per_block(cfg, 16, torch.float32)
    assert per == 2 * 3 * 16 * 1 * 8 * 4
    # one is the scratch block
    assert blocks_for_budget(cfg, 16, torch.float32, num_bytes=per * 11) == 10
    assert blocks_for_budget(cfg, 16, torch.float32) > 1000  # the CPU default budget
    with pytest.raises(ValueError, match="too small"):
        blocks_for_budget(cfg, 16, torch.float32, num_bytes=per)
    with pytest.raises(ValueError, match=">= 1"):
        PagedKVCache(1, 0, 4, 1, 2)
