"""Rank 0's host time building a decode step's inputs, by phase, on this machine's CPU.

    PYTHONPATH=<tree> python benchmarks/decode_inputs_host.py [--batches 1,32,128,256]
        [--modes graph,sync,context] [--new-tokens 40] [--repeats 3] [--json FILE]

Layer 4's engine (async scheduling, greedy, EOS ignored) over a tiny Llama's shapes (vocab
4096) decodes `batch` sequences whose prompts have 64-511 tokens (tables of
4-32 blocks of 16, different lengths: every few steps some sequence's table grows, as in
serving), under layer 5's PhaseClock (step_phases.py: every moment of a decode step charged
to the innermost phase, thread CPU time). The device's work is faked, so a run takes seconds:
the forward returns zero logits, the decode graph's step writes made-up tokens (a function
of the positions) where its greedy tokens go; both are left out of the host time. Modes:

    graph    the GPU's decode path: the CUDA-graph runner run eagerly (capture=False) with its
             inputs through host arrays and copies (GraphInputs(copies=True), as on a GPU,
             without pinning or events); its eager step is "graph launch", left out here
    sync     `graph` under synchronous scheduling: every input token on the host (as in a
             pipeline's lanes, whose steps land before their next step is scheduled)
    context  the path without decode graphs (cuda_graph=False, and what a pipeline's rank 0
             runs: layer 5's stage graphs take the runner's AttentionContext): the cache's
             context, then the eager forward ("forward (eager)", left out, as is the CPU
             kernel of the greedy argmax: one launch on a GPU)

Printed per mode and batch: each input-side phase's CPU us per decode step (the median over
--repeats runs of each run's mean), and the host total (every phase but the forward, the
eager graph step and the waits). Deterministic: same prompts, same steps every run; run it
once per tree (PYTHONPATH) and interleave the trees to compare them on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import layer3_model as l3
from layer4_algorithms import LLM, SamplingParams
from layer4_algorithms.cuda_graph_runner import CudaGraphRunner
from layer5_parallel.bench.step_phases import PhaseClock

PHASES = ("schedule", "input ids", "context", "execute", "graph inputs", "sampling launch",
          "read tokens", "postprocess", "outputs", "other")
LEFT_OUT = ("graph launch", "forward (eager)", "argmax kernel", "wait GPU", "wait ring")


def tiny_model() -> l3.Model:
    cfg = l3.ModelConfig(model_type="llama", vocab_size=4096, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    return l3.Model(l3.random_model(cfg, seed=0))


def prompts(batch: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 4000 + 50 for j in range(64 + (37 * i) % 448)]
            for i in range(batch)]


def graph_runner(llm: LLM) -> None:
    """The runner's decode steps through an eager CudaGraphRunner fed as on a GPU."""
    cfg, cache = llm.config, llm.cache
    max_blocks = -(-cfg.resolved_max_model_len // cache.block_size)
    try:
        graph = CudaGraphRunner(llm.model.net, cache, cfg.max_num_seqs, max_blocks,
                                capture=False, copies=True)
    except TypeError:  # a tree from before the copies option: its buffers swapped in
        from layer4_algorithms.graph_inputs import GraphInputs  # noqa: PLC0415

        graph = CudaGraphRunner(llm.model.net, cache, cfg.max_num_seqs, max_blocks,
                                capture=False)
        g = graph.inputs = GraphInputs(cfg.max_num_seqs, max_blocks, cache.scratch_block,
                                       torch.device("cpu"), copies=True)
        graph.positions, graph.seq_lens = g.positions, g.seq_lens
        graph.block_tables = g.block_tables

    def step(bucket: int) -> None:  # the replay's greedy tokens, made up
        torch.remainder(graph.positions[:bucket] * 31 + 7, 4096, out=graph.input_ids[:bucket])
    graph._step = step
    llm.runner.graph = graph


def fake_forward(llm: LLM) -> None:
    """The network returns zero logits, one row per sequence (every call here is last_only)."""
    vocab = llm.model.net.config.vocab_size

    def forward(ids, ctx, cache=None, *, last_only: bool = False) -> torch.Tensor:
        return torch.zeros((ctx.num_seqs if last_only else ids.shape[0], vocab))
    llm.model.net.forward = forward


def one_run(model: l3.Model, mode: str, batch: int, new_tokens: int) -> dict:
    work = prompts(batch)
    blocks = sum(-(-(len(p) + new_tokens) // 16) for p in work) + 16
    llm = LLM(model, num_blocks=blocks, block_size=16, max_num_seqs=batch, max_model_len=1024,
              max_num_batched_tokens=8192, async_scheduling=mode != "sync")
    fake_forward(llm)
    if mode in ("graph", "sync"):
        graph_runner(llm)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(work[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    clock = PhaseClock(llm)
    clock._wrap(torch.Tensor, "argmax", "argmax kernel")  # the GPU's work (a launch there)
    try:
        llm.generate(work, params)
    finally:
        clock.close()
    s = clock.summary()
    cpu = {p: c for p, (_, c) in s["phases"].items()}
    cpu["host"] = sum(c for p, c in cpu.items() if p not in LEFT_OUT)
    return cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--modes", default="graph,sync,context")
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = tiny_model()
    out = []
    for mode in args.modes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            runs = [one_run(model, mode, batch, args.new_tokens) for _ in range(args.repeats)]
            med = {p: statistics.median(r.get(p, 0.0) for r in runs)
                   for p in (*PHASES, "host")}
            out.append({"mode": mode, "batch": batch, **med})
            print(f"{mode:7} B={batch:3}: " + " ".join(
                f"{p.replace(' ', '_')} {med[p]:.0f}" for p in (*PHASES, "host")
                if med[p] >= 0.5 or p == "host"), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
