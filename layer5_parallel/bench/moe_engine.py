"""An MoE model through the engine, one process vs expert-parallel (`stack bench --layer 5`).

`bench_moe_engine(world)`: a Mixtral-like random MoE model (engine_model.moe_config: 6 experts,
top-2, 8 query / 2 kv heads) through layer 4's engine at TP=1 and at
`tensor_parallel_size=world, enable_expert_parallel=True`, same prompts: tokens/s, whether
the greedy tokens are identical, weight bytes per rank, the expert load (busiest expert and
busiest rank over the mean, from rank 0's counters) and the share of rank 0's step time in
collectives. TP=1 runs on one rank's share of the cores (cores // world), like for like. On
one CPU the ranks share the cores, so this shows the mechanics and the imbalance, not a
speed-up.
"""
from __future__ import annotations

import os
import time

import torch

import layer4_algorithms as engine

from ..expert_parallel.engine_model import (
    expert_load,
    moe_config,
    random_moe_model,
    reset_expert_load,
)
from ..llm import LLM

l3 = engine.executor


def _warm(llm, prompts) -> None:
    llm.generate(prompts[:2], l3.SamplingParams(temperature=0.0, max_tokens=2))
    reset_expert_load(llm)


def _run(llm, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    params = l3.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return sum(map(len, tokens)) / (time.perf_counter() - start), tokens


def bench_moe_engine(world: int = 2, *, num_prompts: int = 16, max_tokens: int = 16,
                     hidden: int = 128, seed: int = 0) -> dict:
    """TP=1 vs EP=world on one MoE model and workload; a dict of plain numbers."""
    config = moe_config(hidden_size=hidden, head_dim=hidden // 8,
                        moe_intermediate_size=2 * hidden, intermediate_size=2 * hidden)
    model = l3.Model(random_moe_model(config, seed=seed))
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(8, 48, (num_prompts,), generator=g).tolist()
    prompts = [torch.randint(0, config.vocab_size, (k,), generator=g).tolist() for k in lens]
    kw = dict(num_blocks=sum(-(-(k + max_tokens) // 16) for k in lens) + 8)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # one rank's share
    try:
        ref = LLM(model, **kw)
        _warm(ref, prompts)
        tps1, tok1 = _run(ref, prompts, max_tokens)
    finally:
        torch.set_num_threads(threads)
    load1 = expert_load(ref, ranks=world)
    with LLM(model, tensor_parallel_size=world, enable_expert_parallel=True, **kw) as llm:
        _warm(llm, prompts)
        comm = llm.tp_group.comm
        before = comm.seconds
        tpsn, tokn = _run(llm, prompts, max_tokens)
        comm_share = (comm.seconds - before) / llm.stats.elapsed_s
        load = expert_load(llm, ranks=world)
        memory = llm.rank_memory()
    return {
        "model": f"MoE {config.num_experts} experts top-{config.num_experts_per_tok}, hidden "
                 f"{hidden}, random fp32", "world": world, "device": "cpu (gloo ranks)",
        "tp1_tok_s": tps1, "ep_tok_s": tpsn, "same_tokens": tok1 == tokn,
        "same_load": [s.tokens_per_expert for s in load["layers"]] ==
                     [s.tokens_per_expert for s in load1["layers"]],
        "expert_max_over_mean": load["max_over_mean"],
        "rank_max_over_mean": load["rank_max_over_mean"],
        "tokens_per_expert_layer0": load["layers"][0].tokens_per_expert,
        "weights_per_rank": [m["weights"] for m in memory],
        "weights_tp1": ref.rank_memory()[0]["weights"],
        "comm_share": comm_share,
    }


def format_moe_engine(r: dict) -> str:
    mib = [f"{w / 2**20:.2f}" for w in r["weights_per_rank"]]
    return "\n".join([
        f"{r['model']} through the engine: TP=1 vs EP={r['world']} ({r['device']})",
        f"  tokens/s {r['tp1_tok_s']:.1f} -> {r['ep_tok_s']:.1f}; identical greedy tokens: "
        f"{r['same_tokens']}; identical expert counts: {r['same_load']}",
        f"  weights MiB per rank {', '.join(mib)} (TP=1: {r['weights_tp1'] / 2**20:.2f}); "
        f"collectives {r['comm_share']:.0%} of rank 0's step",
        f"  load max/mean: experts {r['expert_max_over_mean']:.2f}, ranks "
        f"{r['rank_max_over_mean']:.2f}; layer 0 per expert {r['tokens_per_expert_layer0']}",
    ])
