"""On a GPU: layer 5's engine at TP=1 is layer 4's (same tokens, the benchmark runs); on two
GPUs: TP=2 over NCCL gives TP=1's greedy tokens (near-ties aside, shown by the margin)."""
from __future__ import annotations

import math

import pytest
import torch

import layer5_parallel as l5
from layer5_parallel.bench.tp import bench_tp1_vs_layer4

from .engine_checks import assert_prompts_same_or_near_tie

l3 = l5.engine.executor
PROMPTS = ["ROMEO.\n", "JULIET.\nO Romeo, Romeo", "HAMLET.\nTo be, or not to be", "KING LEAR.\n",
           "MACBETH.\nIs this a dagger", "PORTIA.\nThe quality of mercy", "OTHELLO.\n", "IAGO.\n"]
PARAMS = l5.SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.gpu
def test_tp1_through_layer5_gives_layer4_tokens_on_gpu():
    model = l3.load(l3.course_model_dir("target"), device="cuda")  # the checkpoint's bf16
    ours = l5.LLM(model, tensor_parallel_size=1, num_blocks=256)
    base = l5.engine.LLM(model, num_blocks=256)
    # layer 4's engine, no workers, no pipeline lanes (layer 5's step() is its own only with lanes)
    assert isinstance(ours, l5.engine.LLM) and ours.tp_group is None and ours.lanes is None
    assert _tokens(ours) == _tokens(base)


@pytest.mark.gpu
def test_tp1_vs_layer4_benchmark_runs():
    r = bench_tp1_vs_layer4("cuda", repeats=1, num_prompts=16, max_tokens=16)
    assert r["same_tokens"] and math.isfinite(r["ratio"]) and r["ratio"] > 0


@pytest.mark.multigpu
def test_tp2_nccl_matches_tp1():
    path = l3.course_model_dir("target")
    ref = l5.LLM(path, dtype="float32", device="cuda", num_blocks=256)
    want = _tokens(ref)
    with l5.LLM(path, dtype="float32", device="cuda", num_blocks=256, tensor_parallel_size=2) as tp:
        got = _tokens(tp)
    assert_prompts_same_or_near_tie(ref, PROMPTS, want, got)
    assert torch.cuda.is_available()
