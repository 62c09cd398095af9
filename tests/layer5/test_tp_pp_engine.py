"""Tensor and pipeline parallelism together: TP=2 x PP=2 (4 gloo ranks) equals one process.

Rank r is stage r // 2, shard r % 2: each stage's two ranks split its layers' heads and FFN
(all-reducing in a group of their own) and hand the stream to the same shard of the next
stage. The same random qwen2-shaped model and workload as test_pp_engine.py: prefix caching,
preemption, a forked request (copy-on-write reaching all four ranks); greedy tokens equal
PP=1's (or differ only at a near-tie) and prompt logits within 1e-4.
"""
from __future__ import annotations

import multiprocessing

import pytest
import torch

import layer5_parallel as l5

from . import test_pp_engine
from .test_pp_engine import ENGINE, LOGIT_ATOL, assert_same_or_near_tie, run

# test_pp_engine's fixtures: the same random model and its PP=1 reference run
model, ref = test_pp_engine.model, test_pp_engine.ref


@pytest.fixture(scope="module")
def tp_pp(model):
    with l5.LLM(model, tensor_parallel_size=2, pipeline_parallel_size=2, tp_timeout_s=120,
                **ENGINE) as llm:
        out = run(llm)
        out["memory"] = llm.rank_memory()
        out["busy"] = llm.runner.net.stage_busy()
        yield out
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("l5-rank")]


def test_tp2_pp2_greedy_tokens_and_logits_match_one_process(ref, tp_pp):
    for r in (ref, tp_pp):
        assert r["stats"].preemptions > 0 and len(r["tokens"][3]) == 2
    assert_same_or_near_tie(ref, tp_pp)
    for a, b in zip(ref["logits"], tp_pp["logits"], strict=True):
        torch.testing.assert_close(b, a, atol=LOGIT_ATOL, rtol=0)


def test_each_rank_holds_half_of_its_stages_layers(ref, tp_pp):
    memory = tp_pp["memory"]
    assert [m["rank"] for m in memory] == [0, 1, 2, 3]
    layers = [len(r) for r in l5.partition(5, 2)]  # 3 + 2
    per_layer_kv = ref["llm"].cache.nbytes // 5  # kv_heads 2 -> one head per shard
    assert [m["kv"] for m in memory] == [n * per_layer_kv // 2 for n in layers for _ in (0, 1)]
    full = sum(p.numel() * 4 for p in ref["llm"].model.net.parameters())
    # every weight on one rank, but the norms (on both shards) and the vocab's padding row
    assert full < sum(m["weights"] for m in memory) < 1.02 * full
    assert memory[0]["weights"] == memory[1]["weights"]
    assert [row["stage"] for row in tp_pp["busy"]] == [0, 0, 1, 1]
    assert all(row["busy_s"] > 0 for row in tp_pp["busy"])

