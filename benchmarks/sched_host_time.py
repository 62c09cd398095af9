"""Layer 4's scheduler and postprocess alone: host microseconds per decode step by phase.

    python benchmarks/sched_host_time.py [--seqs 32,128,256] [--steps 200] [--repeats 5]
                                         [--profile N]

No model and no engine: a Scheduler over a BlockManager with `--seqs` sequences (16-token
prompts, token ids only, greedy, EOS ignored: the GPU engine benchmark's workload) is driven
as the async engine drives it, one decode step after another:
    schedule     Scheduler.schedule()                          (step N + 1)
    launch       LaunchedStep.on_device: the sampled rows' bookkeeping (num_pending, rows)
    read         LaunchedStep.read(): step N's tokens to the host's per-sequence lists
    postprocess  Scheduler.postprocess(): append, stop checks, prefix-cache commits, frees
    outputs      RequestOutput.of(..., delta=True) for every sequence (layer 6's stream)
The "sampled tokens" are a CPU tensor (what the pinned copy of a GPU step holds). Each phase
is timed with time.thread_time (this thread's CPU time: what other processes on a shared
machine do is left out); printed: the median over --repeats runs of each run's median per
step. The sequences never finish inside the timed steps (max_tokens is larger).
--profile N: cProfile of N steps at the largest --seqs, top functions by own time.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import layer3_model as l3
from layer4_algorithms import EngineConfig, RequestOutput, Scheduler, Sequence
from layer4_algorithms.kv import BlockManager
from layer4_algorithms.launched_step import LaunchedStep

PHASES = ("schedule", "launch", "read", "postprocess", "outputs")


def build(num_seqs: int, steps: int) -> tuple[Scheduler, list[Sequence]]:
    """A scheduler with num_seqs sequences admitted and prefilled, each with its first token."""
    config = EngineConfig(num_blocks=num_seqs * (2 + (16 + steps + 8) // 16), block_size=16,
                          max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, 16 * num_seqs),
                          max_model_len=16 + steps + 64)
    bm = BlockManager.from_config(config)
    sched = Scheduler(bm, config)
    params = l3.SamplingParams(temperature=0.0, max_tokens=steps + 32, ignore_eos=True)
    seqs = [Sequence(i, str(i), [(7 * i + j) % 4000 + 50 for j in range(16)], params)
            for i in range(num_seqs)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()  # the prefill: every prompt at once
    sched.postprocess(out, {s.seq_id: [s.seq_id % 4000 + 1] for s in seqs})
    return sched, seqs


def run(num_seqs: int, steps: int, profiler: cProfile.Profile | None = None) -> dict[str, float]:
    """Median thread-CPU microseconds per step of each phase over `steps` decode steps."""
    sched, seqs = build(num_seqs, steps)
    clock = time.thread_time
    spent: dict[str, list[float]] = {p: [] for p in PHASES}
    prev = None
    if profiler is not None:
        profiler.enable()
    for k in range(steps + 1):
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        who = [s.seq for s in out.scheduled]
        tokens = torch.arange(k, k + len(who)) % 4000 + 1
        launched = LaunchedStep.on_device(out, who, tokens, None)
        t2 = clock()
        if prev is not None:
            sampled = prev.read()
            t3 = clock()
            sched.postprocess(prev.out, sampled)
            t4 = clock()
            now = time.perf_counter()
            for s in seqs:
                RequestOutput.of(s.request_id, None, [s], now, delta=True)
            t5 = clock()
            for p, sec in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                spent[p].append(sec * 1e6)
        prev = launched
    if profiler is not None:
        profiler.disable()
    if any(s.finish_reason is not None for s in seqs):
        raise RuntimeError("a sequence finished inside the timed steps")
    return {p: statistics.median(v) for p, v in spent.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="32,128,256")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0)
    args = ap.parse_args()
    sizes = [int(x) for x in args.seqs.split(",")]
    torch.set_num_threads(1)
    run(sizes[0], 20)  # warm up
    print(f"scheduler + postprocess host time per decode step (us, thread CPU; median of "
          f"{args.repeats} runs of {args.steps} steps), torch {torch.__version__}", flush=True)
    print(f"{'seqs':>5} " + " ".join(f"{p:>11}" for p in PHASES) + f" {'total':>8}"
          + f" {'us/seq':>7}", flush=True)
    for n in sizes:
        runs = [run(n, args.steps) for _ in range(args.repeats)]
        med = {p: statistics.median(r[p] for r in runs) for p in PHASES}
        total = sum(med.values())
        print(f"{n:5d} " + " ".join(f"{med[p]:11.1f}" for p in PHASES)
              + f" {total:8.1f} {total / n:7.2f}", flush=True)
    if args.profile:
        prof = cProfile.Profile()
        run(sizes[-1], args.profile, prof)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
