"""Ring attention equals full causal attention (torch SDPA), on gloo ranks and simulated.

Fresh random inputs every run (seed in the failure message); awkward sizes: sequence lengths
no 2N divides, one shorter than 2N chunks (empty chunks), GQA (6 query heads on 2 or 3 kv
heads), batch 2.
"""
from __future__ import annotations

import importlib
import random

import pytest
import torch
import torch.nn.functional as F

import layer5_parallel as l5

from .engine_checks import assert_ranks_match

# layer 2's launch: ranks forked from one server (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("fork_server_module")

# the module, not the function of the same name that layer5_parallel exports
ra = importlib.import_module("layer5_parallel.context_parallel.ring_attention")

seeds = random.SystemRandom()
CASES = [(2, 6, 2, 37, 8), (1, 6, 3, 11, 4), (1, 4, 4, 5, 8), (2, 2, 1, 64, 16)]  # B,H,Hkv,S,D


def _inputs(case: tuple, seed: int) -> tuple[torch.Tensor, ...]:
    B, H, Hkv, S, D = case
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g),
            torch.randn(B, Hkv, S, D, generator=g))


def _full(q, k, v, causal=True):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def rank_checks(seed: int) -> list[tuple]:
    comm = l5.engine.executor.comm
    me, p = comm.rank(), comm.world_size()
    results = []
    for case in CASES:
        q, k, v = _inputs(case, seed)
        S = q.shape[-2]
        shard = [ra.shard_sequence(t, me, p) for t in (q, k, v)]
        got = l5.ring_attention(*shard, S, timeout_s=30)
        want = ra.shard_sequence(_full(q, k, v), me, p)
        results.append((case, {"out": (got, want)}))
    q, k, v = _inputs(CASES[0], seed)
    got = l5.ring_attention(*[ra.shard_sequence(t, me, p) for t in (q, k, v)], q.shape[-2],
                            causal=False)
    results.append(("non-causal", {"out": (got, ra.shard_sequence(_full(q, k, v, False), me, p))}))
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_ring_attention_on_ranks_equals_full_attention(world):
    assert_ranks_match(rank_checks, world, seeds.randrange(2**31))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_simulated_schedule_and_sharding(world):
    seed = seeds.randrange(2**31)
    for case in CASES:
        q, k, v = _inputs(case, seed)
        got = ra.ring_attention_simulated(q, k, v, world)
        torch.testing.assert_close(got, _full(q, k, v), rtol=1e-4, atol=1e-5,
                                   msg=f"world {world}, case {case}, seed {seed}")
        shards = [ra.shard_sequence(q, r, world) for r in range(world)]
        assert torch.equal(ra.unshard_sequence(shards), q)


def test_merge_is_exact_in_any_order():
    g = torch.Generator().manual_seed(seeds.randrange(2**31))
    q, k, v = (torch.randn(1, 4, 9, 8, generator=g) for _ in range(3))
    pos = torch.arange(9)
    out, lse = torch.zeros(1, 4, 9, 8), torch.full((1, 4, 9), float("-inf"))
    for idx in torch.randperm(9, generator=g).split(2):  # key blocks in a random order
        o, lb = ra.attention_block(q, k[:, :, idx], v[:, :, idx], pos, idx)
        out, lse = ra.merge_partial(out, lse, o, lb)
    torch.testing.assert_close(out, _full(q, k, v), rtol=1e-5, atol=1e-6)
    assert not out.isnan().any()


def test_load_balanced_chunks_even_out_causal_work():
    naive, balanced = ra.causal_work(4096, 4, balanced=False), ra.causal_work(4096, 4)
    assert max(naive) / min(naive) > 6  # the last rank does ~7x the first's work
    assert max(balanced) / min(balanced) < 1.01
    assert sum(naive) == sum(balanced) == 4096 * 4097 // 2


def disagreeing_ranks() -> None:
    """Rank 1 thinks the sequence is one token longer: every rank must say so, not hang."""
    comm = l5.engine.executor.comm
    me, p = comm.rank(), comm.world_size()
    S = 9 + me
    q, k = torch.randn(1, 2, S, 4), torch.randn(1, 1, S, 4)
    l5.ring_attention(*(ra.shard_sequence(t, me, p) for t in (q, k, k)), S, timeout_s=10)


def test_ranks_that_disagree_fail_on_every_rank():
    with pytest.raises(RuntimeError) as failed:
        l5.engine.executor.comm.launch(disagreeing_ranks, 2, backend="gloo", timeout_s=60)
    text = str(failed.value)
    for rank in (0, 1):
        said = f"rank {rank} raised ValueError: ring_attention: ranks disagree"
        assert said in text, text[-2000:]


def test_bad_shapes_are_named():
    q, k = torch.randn(1, 5, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        ra.attention_block(q, k, k, torch.arange(4), torch.arange(4))
    with pytest.raises(ValueError, match="holds 4 of 4 positions"):  # world of one, wrong length
        l5.ring_attention(torch.randn(1, 2, 3, 8), k[:, :, :3], k[:, :, :3], 4)


@pytest.mark.gpu
def test_ring_schedule_on_cuda_equals_sdpa():
    """The same blocks and merge on CUDA tensors (one GPU: the ring simulated in-process)."""
    seed = seeds.randrange(2**31)
    for case in CASES:
        q, k, v = (t.cuda() for t in _inputs(case, seed))
        got = ra.ring_attention_simulated(q, k, v, 3)
        torch.testing.assert_close(got, _full(q, k, v), rtol=1e-4, atol=1e-4,
                                   msg=f"case {case}, seed {seed}")
