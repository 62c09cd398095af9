"""Where a batch-1 decode step of Llama-3.2-1B's shape (random bf16 weights) spends GPU time.

    python benchmarks/profile_decode.py [--backend triton] [--unfused]

Profiles a few eager decode steps with torch.profiler and prints the kernels by total GPU
time and the launches per step, so the gap between the step time and weights / copy
bandwidth can be attributed (small kernels vs slow GEMVs). The triton backend takes its fused
decode path (backends.DecodeKernels); --unfused turns it off (the general path)."""
from __future__ import annotations

import argparse
import dataclasses

import torch
from torch.profiler import ProfilerActivity, profile

import layer3_model as l3
from layer3_model.shapes import LLAMA_3_2_1B

ap = argparse.ArgumentParser()
ap.add_argument("--backend", default="triton")
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--unfused", action="store_true", help="the general decode path")
args = ap.parse_args()
net = l3.random_model(l3.ModelConfig.from_dict(LLAMA_3_2_1B), backend=args.backend,
                      dtype=torch.bfloat16, device="cuda")
if args.unfused:
    net.ops = dataclasses.replace(net.ops, decode=None)
cache = l3.ContiguousKVCache.for_model(net.config, 1, 256, dtype=net.dtype, device="cuda")
with torch.no_grad():
    net(torch.randint(0, 1000, (128,), device="cuda"), cache.context([128], [0]), cache,
        last_only=True)
    tok = torch.tensor([5], device="cuda")
    for i in range(3):
        net(tok, cache.context([1], [128 + i]), cache, last_only=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(args.steps):
            net(tok, cache.context([1], [128 + i]), cache, last_only=True)
        torch.cuda.synchronize()
rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))
total = sum(getattr(e, "self_device_time_total", 0) for e in rows)
n_kernels = sum(e.count for e in rows if getattr(e, "self_device_time_total", 0) > 0)
path = "unfused" if args.unfused or net.ops.decode is None else "fused"
print(f"backend {args.backend} ({path} decode): {total / args.steps / 1e3:.3f} ms of kernel "
      f"time per step, {n_kernels / args.steps:.0f} kernels per step")
for e in rows[:25]:
    t = getattr(e, "self_device_time_total", 0)
    if t:
        print(f"{t / args.steps:9.1f} us/step  {e.count / args.steps:6.1f}x  "
              f"{t / e.count:8.2f} us each  {e.key[:90]}")
