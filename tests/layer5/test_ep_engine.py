"""An MoE model through layer 4's engine (paged KV, continuous batching), alone and with its
experts split over tensor-parallel ranks (`enable_expert_parallel=True`).

Reference: the same MoE model in this process (TP=1, layer 4's engine as it is), itself checked
against the plain MoE block (moe.py) and against a no-cache recompute of every position.
Awkward shapes: 6 experts on 4 ranks (2, 2, 1, 1 experts), top-2, 8 query / 2 kv heads (kv
replicated at 4 ranks), vocab 211; a Qwen-MoE-like variant with a shared expert and a tight
capacity (drops). Gloo ranks on the CPU, fp32; a token may differ only at a near-tie of TP=1's
own logits (shown by the margin), logits within 1e-3, load statistics identical.
"""
from __future__ import annotations

import random

import pytest
import torch

import layer5_parallel as l5
from layer5_parallel.bench.moe_engine import bench_moe_engine, format_moe_engine
from layer5_parallel.expert_parallel.engine_model import (
    MoEMLP,
    expert_load,
    moe_config,
    random_moe_model,
    reset_expert_load,
)
from layer5_parallel.expert_parallel.moe import MoEBlock

from .engine_checks import NEAR_TIE, assert_all_same_or_near_tie

l3 = l5.engine.executor
MAX_TOKENS = 8
LOGIT_ATOL = 1e-3
SHARED = dict(num_experts=8, moe_intermediate_size=20, shared_expert_intermediate_size=44,
              capacity_factor=1.0)  # Qwen-MoE-like: a shared expert; capacity 1.0 drops some


def prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 21, (n,), generator=g).tolist()
    return [torch.randint(0, 211, (k,), generator=g).tolist() for k in lens]


def run(llm, ps) -> dict:
    """Greedy tokens, the fp32 logits of prompt + tokens (one no-cache prefill), load stats."""
    reset_expert_load(llm)
    outs = llm.generate(ps, l5.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                              ignore_eos=True))
    tokens = [o.outputs[0].token_ids for o in outs]
    load = expert_load(llm, ranks=llm.tensor_parallel_size)
    logits = llm.prompt_logits([p + t for p, t in zip(ps, tokens, strict=True)])
    return {"ids": ps, "tokens": tokens, "logits": logits, "load": load, "llm": llm,
            "memory": llm.rank_memory()}


def engines(config, sizes: list[tuple[int, bool, str]]) -> list[dict]:
    """TP=1 first, then each (tp, expert_parallel, backend) in turn (workers stopped after)."""
    model = l3.Model(random_moe_model(config, seed=1))
    ps = prompts()
    out = [run(l5.LLM(model, num_blocks=64, block_size=8), ps)]
    for tp, ep, backend in sizes:
        with l5.LLM(model, tensor_parallel_size=tp, enable_expert_parallel=ep, num_blocks=64,
                    block_size=8, tp_backend=backend) as llm:
            out.append(run(llm, ps))
    return out


@pytest.fixture(scope="module")
def mixtral_like():
    return engines(moe_config(), [(2, True, "torch"), (4, True, "ours")])


@pytest.fixture(scope="module")
def qwen_like():
    return engines(moe_config(**SHARED), [(2, True, "torch"), (2, False, "torch")])


def assert_matches(ref: dict, got: dict) -> None:
    assert_all_same_or_near_tie(ref, got)
    if got["tokens"] == ref["tokens"]:
        for a, b in zip(ref["logits"], got["logits"], strict=True):
            torch.testing.assert_close(b, a, atol=LOGIT_ATOL, rtol=0)
        # routing is replicated: rank 0 saw every assignment, exactly as one process did
        assert [s.tokens_per_expert for s in got["load"]["layers"]] == \
            [s.tokens_per_expert for s in ref["load"]["layers"]]
        assert [s.dropped for s in got["load"]["layers"]] == \
            [s.dropped for s in ref["load"]["layers"]]


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_moe_mlp_is_the_moe_block(capacity_factor):
    """The engine's MoE MLP computes moe.py's reference block (same weights, fresh inputs)."""
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    config = moe_config(num_experts=5, capacity_factor=capacity_factor)
    H, F, E = config.hidden_size, config.moe_intermediate_size, config.num_experts
    block = MoEBlock(H, F, E, 2, capacity_factor, generator=g)
    mlp = MoEMLP(config).reset_counters("cpu")
    with torch.no_grad():
        mlp.router.weight.copy_(block.router)
        mlp.gate_up.copy_(torch.cat([block.w_gate, block.w_up], dim=1))
        mlp.down.copy_(block.w_down)
    x = torch.randn(37, H, generator=g)
    want, routing = block(x)
    got = mlp(x, l3.LlamaModel(config).ops)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"seed {seed}")
    assert mlp.load.tolist() == torch.bincount(routing.experts.flatten(), minlength=E).tolist()
    assert int(mlp.dropped) == int((~routing.kept).sum())


def test_moe_engine_equals_no_cache_recompute(mixtral_like):
    """TP=1: the paged-KV engine's greedy tokens are the argmax of a full recompute."""
    ref = mixtral_like[0]
    for ids, toks, logits in zip(ref["ids"], ref["tokens"], ref["logits"], strict=True):
        picks = logits[len(ids) - 1: len(ids) - 1 + len(toks)]
        for j, (want, row) in enumerate(zip(toks, picks, strict=True)):
            top = int(row.argmax())
            assert top == want or float(row[top] - row[want]) < NEAR_TIE, (j, top, want)


def test_ep2_and_ep4_match_one_process(mixtral_like):
    ref, ep2, ep4 = mixtral_like
    assert_matches(ref, ep2)
    assert_matches(ref, ep4)
    assert ep2["tokens"] == ref["tokens"] and ep4["tokens"] == ref["tokens"]


def test_ep_splits_the_experts_and_reports_imbalance(mixtral_like):
    ref, ep2, ep4 = mixtral_like
    E, layers = 6, 2
    full = ref["memory"][0]["weights"]
    # each rank holds its experts only: rank 0 of 4 has 2 of 6, rank 3 has 1 of 6
    w4 = [m["weights"] for m in ep4["memory"]]
    assert w4[0] == w4[1] > w4[2] == w4[3] and max(w4) < full / 2
    assert ep2["memory"][0]["weights"] == ep2["memory"][1]["weights"] < full
    load = ep4["load"]
    assert len(load["layers"]) == layers
    for stats, per_rank in zip(load["layers"], load["per_rank"], strict=True):
        t = stats.tokens_per_expert
        assert len(t) == E and per_rank == [t[0] + t[1], t[2] + t[3], t[4], t[5]]
        assert sum(t) == stats.assignments
    assert load["max_over_mean"] >= 1.0 and load["rank_max_over_mean"] >= 1.0


def test_shared_expert_capacity_ep_and_tp_sharded_experts(qwen_like):
    """Shared expert + drops at capacity 1.0: EP=2 and TP=2 (each expert's FFN split) both equal
    one process, drops included."""
    ref, ep2, tp2 = qwen_like
    assert sum(s.dropped for s in ref["load"]["layers"]) > 0  # capacity did drop some
    assert_matches(ref, ep2)
    assert_matches(ref, tp2)


def test_expert_parallel_bad_input():
    with pytest.raises(ValueError, match="needs an MoE model"):
        l5.LLM(l3.course_model_dir("target"), enable_expert_parallel=True, num_blocks=8)
    model = l3.Model(random_moe_model(moe_config(), seed=0))
    with pytest.raises(ValueError, match=r"6 experts cannot be split .* valid sizes: 1..6"):
        l5.LLM(model, tensor_parallel_size=8, enable_expert_parallel=True, num_blocks=8)
    with pytest.raises(ValueError, match="enable_expert_parallel must be a bool"):
        l5.EngineConfig(enable_expert_parallel="yes")
    with pytest.raises(ValueError, match="cannot capture an MoE model"):
        l5.LLM(model, cuda_graph=True, num_blocks=8)


@pytest.mark.gpu
def test_moe_engine_on_gpu_matches_recompute():
    """One GPU: the MoE model (shared expert) through layer 5's engine at TP=1 (EP=1), fp32
    without TF32 (a training test may have turned it on): greedy tokens are the argmax of a
    no-cache recompute on the GPU, near-ties aside; the load counters counted every token."""
    matmul = torch.backends.cuda.matmul
    saved, matmul.allow_tf32 = matmul.allow_tf32, False
    try:
        config = moe_config(shared_expert_intermediate_size=44)
        net = random_moe_model(config, seed=1, device="cuda")
        got = run(l5.LLM(l3.Model(net), num_blocks=64, block_size=8,
                         enable_expert_parallel=True), prompts())
    finally:
        matmul.allow_tf32 = saved
    assert got["logits"][0].is_cuda
    for ids, toks, logits in zip(got["ids"], got["tokens"], got["logits"], strict=True):
        picks = logits[len(ids) - 1: len(ids) - 1 + len(toks)]
        for want, row in zip(toks, picks, strict=True):
            top = int(row.argmax())
            assert top == want or float(row[top] - row[want]) < NEAR_TIE
    per_layer = sum(len(p) + MAX_TOKENS - 1 for p in got["ids"]) * config.num_experts_per_tok
    assert [s.assignments for s in got["load"]["layers"]] == [per_layer] * 2


def test_moe_engine_bench_runs_and_agrees():
    r = bench_moe_engine(2, num_prompts=4, max_tokens=4, hidden=64)
    assert r["same_tokens"] and r["same_load"], r
    assert r["weights_per_rank"][0] < r["weights_tp1"] and 0 <= r["comm_share"] <= 1
    assert "EP=2" in format_moe_engine(r)
