"""Expert parallelism equals the single-process MoE block, on gloo ranks of this CPU.

Fresh random inputs every run (the seed is in every failure message), awkward sizes: token
counts no rank count divides (some ranks hold no token at all), k=2, E=6 on 2 and 3 ranks, E=5
on 2 ranks (uneven expert split), tight capacity (drops) and unlimited capacity.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import layer5_parallel as l5
from layer5_parallel.expert_parallel.model import (
    MIXTRAL_TINY,
    QWEN_MOE_TINY,
    ExpertParallelModel,
    MoETransformer,
)
from layer5_parallel.expert_parallel.moe import MoEBlock, route, stats_of

# layer 2's launch: ranks forked from one server (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("fork_server_module")

seeds = random.SystemRandom()
LAUNCH = l5.engine.executor.comm.launch
CASES = [  # (tokens, hidden, ffn, experts, k, capacity_factor)
    (37, 24, 40, 6, 2, 1.0),
    (2, 16, 24, 6, 2, 0.5),  # fewer tokens than ranks on 3 ranks
    (53, 16, 20, 5, 2, None),
    (29, 12, 16, 6, 1, 0.75),
]


def _block(case: tuple, seed: int) -> tuple[MoEBlock, torch.Tensor]:
    T, D, F, E, k, cf = case
    g = torch.Generator().manual_seed(seed)
    block = MoEBlock(D, F, E, k, cf, generator=g)
    return block, torch.randn(T, D, generator=g)


def rank_checks(seed: int) -> list[dict]:
    """Every rank: run each case with EP over its contiguous token range; return its slice of
    the output beside the single-process block's, and the statistics."""
    comm = l5.engine.executor.comm
    me, p = comm.rank(), comm.world_size()
    out = []
    for case in CASES:
        block, x = _block(case, seed)
        if block.num_experts < p:
            continue
        a, b = comm.segment_bounds(x.shape[0], p)[me]
        y, stats = l5.ExpertParallelMoE(block).forward(x[a:b])
        with torch.no_grad():
            want, routing = block(x)
        out.append(dict(case=case, got=y.detach(), want=want[a:b], stats=stats,
                        want_stats=stats_of(routing, block.num_experts)))
    # whole models: 3 sequences of 7 tokens, split by sequence (one rank may hold none)
    for config in (dataclasses.replace(MIXTRAL_TINY, capacity_factor=1.0), QWEN_MOE_TINY):
        model = MoETransformer(config, seed=seed)
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, config.vocab, (3, 7), generator=g)
        a, b = comm.segment_bounds(3, p)[me]
        logits, stats = ExpertParallelModel(model)(tokens[a:b])
        with torch.no_grad():
            want, want_stats = model(tokens)
        out.append(dict(case=config, got=logits, want=want[a:b], stats=stats,
                        want_stats=want_stats))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_expert_parallel_equals_single_process(world):
    seed = seeds.randrange(2**31)
    reports = LAUNCH(rank_checks, world, seed, backend="gloo", timeout_s=60)
    for rank, report in enumerate(reports):
        assert len(report) == len(CASES) + 2
        for r in report:
            where = f"rank {rank}/{world}, case {r['case']}, seed {seed}"
            torch.testing.assert_close(r["got"], r["want"], rtol=1e-5, atol=1e-5, msg=where)
            assert r["stats"] == r["want_stats"], where


def one_rank_gets_a_bad_input() -> None:
    block = MoEBlock(8, 8, 4, generator=torch.Generator().manual_seed(0))
    width = 8 if l5.engine.executor.comm.rank() == 0 else 7
    l5.ExpertParallelMoE(block)(torch.randn(3, width))


def test_a_bad_input_on_one_rank_fails_every_rank():
    with pytest.raises(RuntimeError) as failed:
        l5.engine.executor.comm.launch(one_rank_gets_a_bad_input, 2, backend="gloo",
                                       timeout_s=60)
    for rank in (0, 1):
        said = f"rank {rank} raised ValueError: ExpertParallelMoE: rank 1 of 2 got a bad input"
        assert said in str(failed.value), str(failed.value)[-2000:]


def test_capacity_drops_second_choices_first():
    g = torch.Generator().manual_seed(seeds.randrange(2**31))
    T, E, k = 41, 4, 2
    logits = torch.randn(T, E, generator=g)
    logits[:, 0] += 20.0  # everyone's favourite (by far): expert 0 overflows
    r = route(logits, k, capacity_factor=1.0)
    assert r.capacity == 21
    for e in range(E):
        assert int(((r.experts == e) & r.kept).sum()) <= r.capacity
    # expert 0 is every token's first choice: exactly the first 21 tokens keep it
    assert (r.experts[:, 0] == 0).all()
    assert r.kept[:21, 0].all() and not r.kept[21:, 0].any()
    stats = stats_of(r, E)
    assert stats.dropped == int((~r.kept).sum()) > 0
    assert stats.max_over_mean == pytest.approx(max(stats.tokens_per_expert) / (T * k / E))
    torch.testing.assert_close(r.gates.sum(-1), torch.ones(T))


def test_dropped_tokens_get_zero_and_unlimited_capacity_drops_none():
    block, x = _block((30, 16, 24, 6, 2, 0.25), seeds.randrange(2**31))
    with torch.no_grad():
        y, r = block(x)
        all_dropped = ~r.kept.any(1)
        assert all_dropped.any()
        assert (y[all_dropped] == 0).all()
        block.capacity_factor = None
        _, r2 = block(x)
    assert r2.kept.all()


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="k must be"):
        MoEBlock(8, 8, 4, k=5)
    with pytest.raises(ValueError, match="valid sizes: 1..4"):
        l5.expert_parallel.expert_ranges(4, 6)
    with pytest.raises(ValueError, match="capacity_factor"):
        route(torch.randn(3, 4), 2, capacity_factor=0.0)
    block = MoEBlock(8, 8, 4)
    with pytest.raises(ValueError, match=r"\(\.\.\., 8\)"):
        block(torch.randn(3, 7))


def test_imbalance_table_and_its_format():
    rows = l5.moe_imbalance(batch=2, seq=16)
    assert len(rows) == 6
    for r in rows:
        assert r["max_over_mean"] >= 1.0 and r["worst_layer"] >= r["max_over_mean"]
        assert (r["dropped"] == 0) == (r["capacity_factor"] is None) or r["dropped"] == 0
        assert sum(r["tokens_per_expert_layer0"]) == 2 * 16 * (2 if "mixtral" in r["model"] else 4)
    ring = [dict(seq_len=8, max_error=0.0, ring_s=0.1, full_s=0.01,
                 work_max_over_min_contiguous=3.0, work_max_over_min_balanced=1.0)]
    result = dict(world=2, ring=ring, moe=rows, ep_equal_single_process=True)
    text = l5.format_expert_context(result)
    assert "mixtral-tiny" in text and "max/mean" in text
