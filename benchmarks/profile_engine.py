"""Where one decode step of layer 4's engine goes: host stages vs GPU kernels.

    python benchmarks/profile_engine.py [--seqs 256] [--steps 20]

Llama-3.2-1B's shape with random bf16 weights; `--seqs` requests with prompts uniform in
100-1024 tokens are admitted and prefilled first, then decode-only steps (CUDA graphs) are
timed: wall time per step, each host stage (schedule, context, sample, postprocess, outputs)
and, under torch.profiler, the GPU kernels by total time. The gap between wall time and
kernel time is host overhead the GPU waits for (the step ends in one host sync)."""
from __future__ import annotations

import argparse
import collections
import functools
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

import layer3_model as l3
from layer4_algorithms import LLM, SamplingParams
from layer4_algorithms import engine as E
from layer4_algorithms import model_runner as MR
from layer4_algorithms import scheduler as S
from layer4_algorithms.kv import paged_cache as PC

ap = argparse.ArgumentParser()
ap.add_argument("--seqs", type=int, default=256)
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--smoke", action="store_true",
                help="a tiny model on the CPU: checks the script runs")
args = ap.parse_args()

STAGES: collections.Counter = collections.Counter()


def timed(cls, name: str) -> None:
    f = getattr(cls, name)

    @functools.wraps(f)
    def wrapper(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        STAGES[name] += time.perf_counter() - t
        return r
    setattr(cls, name, wrapper)


for cls, name in [(S.Scheduler, "schedule"), (S.Scheduler, "postprocess"),
                  (PC.PagedKVCache, "context"),
                  (MR.ModelRunner, "sample"), (MR.ModelRunner, "execute"), (E.LLM, "_outputs")]:
    timed(cls, name)

shape, dev, dtype = dict(l3.LLAMA_3_2_1B), "cuda", torch.bfloat16
if args.smoke:
    shape.update(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)
    dev, dtype = "cpu", torch.float32
net = l3.random_model(l3.ModelConfig.from_dict(shape), backend="triton", dtype=dtype, device=dev)
llm = LLM(l3.Model(net, None), max_num_seqs=args.seqs, block_size=16, max_num_batched_tokens=8192,
          cuda_graph=True, max_model_len=2112, num_blocks=None if dev == "cuda" else 40000)
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
rng = random.Random(0)
for i in range(args.seqs):
    prompt = [rng.randrange(1000, 100000) for _ in range(rng.randint(100, 1024))]
    llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True),
                    str(i))
while llm.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in llm.scheduler.running):
    llm.step()
print(f"{len(llm.scheduler.running)} sequences decoding after {llm.stats.steps} steps")
for _ in range(3):
    llm.step()
sync()
STAGES.clear()
t0 = time.perf_counter()
for _ in range(args.steps):
    llm.step()
sync()
wall = (time.perf_counter() - t0) / args.steps
print(f"wall {wall * 1e3:.2f} ms per decode step at batch {args.seqs}")
for k, v in STAGES.most_common():
    print(f"  {k:12s} {v / args.steps * 1e3:7.2f} ms/step")
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
with profile(activities=activities) as prof:
    for _ in range(5):
        llm.step()
    sync()
rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))
gpu = sum(getattr(e, "self_device_time_total", 0) for e in rows)
print(f"GPU kernel time {gpu / 5 / 1e3:.2f} ms per step")
for e in rows[:15]:
    t = getattr(e, "self_device_time_total", 0)
    if t:
        print(f"{t / 5:9.1f} us/step  {e.count / 5:6.1f}x  {e.key[:100]}")
cpu_rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
print("host: top ops by self CPU time")
for e in cpu_rows[:15]:
    print(f"{e.self_cpu_time_total / 5:9.1f} us/step  {e.count / 5:6.1f}x  {e.key[:100]}")
