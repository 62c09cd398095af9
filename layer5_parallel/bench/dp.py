"""Data parallelism against one GPU and against tensor and pipeline parallelism on the same GPUs.

    python -m layer5_parallel.bench.dp --dp 2 --out dp.json     # on a machine with 2 GPUs

nano-vllm's workload: 256 sequences of random token ids, prompts of 100..1024 tokens,
100..`--max-out` new tokens each (ignore_eos), on a Llama-3.2-1B-shaped model with random
bf16 weights (said so; a CPU gets the course model and a small workload). Each layout runs
in processes of its own (a `ReplicaSet`, so every layout pays the same overheads), after a
warm-up, timed from this process around one `generate`:

    1 GPU        one engine (and without CUDA graphs, as the pipeline runs)
    DP=N         N engines, one per GPU, each a contiguous share of the sequences
    TP=N         one engine over N GPUs (every layer split)
    PP=N         one engine over N GPUs (the layers cut into stages), micro-batches 1 and N

and reports output tokens/s, each as a ratio to 1 GPU, and whether the greedy tokens equal
1 GPU's. When the model fits one GPU, DP=N should approach N x (target >= 0.9 N): nothing
crosses between replicas, while TP pays its all-reduces every layer and PP its bubble.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import layer4_algorithms as engine

from ..data_parallel.replicas import ReplicaSet
from .tp import workload

l3 = engine.executor


def llama_1b(device: str) -> l3.Model:
    """A Llama-3.2-1B-shaped model with random bf16 weights on `device` (a replica calls it)."""
    config = l3.ModelConfig.from_dict(l3.LLAMA_3_2_1B)
    return l3.Model(l3.random_model(config, dtype=torch.bfloat16, device=device))


def course(device: str) -> l3.Model:
    return l3.load(l3.course_model_dir("target"), dtype="float32", device=device)


def wait_for_free_gpus(gpus: int, timeout_s: float = 60.0) -> None:
    """Until every GPU is (nearly) empty: the last layout's processes may still be freeing
    theirs, and a replica sizes its KV cache from the memory free when it starts."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = [torch.cuda.mem_get_info(i) for i in range(gpus)]  # (free, total) bytes
        if all(free > 0.9 * total for free, total in info):
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(f"  (GPUs still busy after {timeout_s:g} s: free "
          f"{[round(free / 2**30, 1) for free, _ in info]} GiB)", flush=True)


def run_layout(name: str, factory, prompts, max_tokens: list[int], **sizes) -> dict:
    """One layout in processes of its own: warm up, then time one generate of every prompt."""
    start = time.perf_counter()
    with ReplicaSet(factory, **sizes) as llm:
        ready_s = time.perf_counter() - start
        llm.generate(prompts[:8], l3.SamplingParams(temperature=0.0, max_tokens=8,
                                                    ignore_eos=True))
        params = [l3.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                  for m in max_tokens]
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    n = sum(map(len, tokens))
    return {"layout": name, "sizes": {k: v for k, v in sizes.items() if k != "dp_devices"},
            "devices": list(sizes.get("dp_devices") or ()), "seconds": wall,
            "output_tokens": n, "tok_s": n / wall, "startup_s": ready_s, "tokens": tokens}


def bench_dp(dp: int = 2, *, num_seqs: int = 256, max_in: int = 1024, max_out: int = 1024,
             layouts: tuple[str, ...] = ("1", "dp", "tp", "pp1", "ppN"), seed: int = 0,
             **engine_kw) -> dict:
    """Every layout in `layouts` ("1", "1ng": without CUDA graphs, "dp", "tp", "pp1": PP=dp
    with one micro-batch, "ppN": PP=dp with dp micro-batches) on the same workload; rows and
    ratios to the first."""
    gpus = torch.cuda.device_count()
    on_gpu = gpus >= dp
    factory = llama_1b if on_gpu else course
    vocab = 128256 if on_gpu else 2048
    if not on_gpu:  # a CPU: the course model, a workload that finishes
        num_seqs, max_in, max_out = min(num_seqs, 8), min(max_in, 32), min(max_out, 16)
    g = torch.Generator().manual_seed(seed + 1)
    min_in, min_out = min(100, max_in), min(100, max_out)
    prompts = workload(num_seqs, vocab, min_in, max_in, seed)
    max_tokens = torch.randint(min_out, max_out + 1, (num_seqs,), generator=g).tolist()
    devs = [str(i) for i in range(dp)] if on_gpu else ["cpu"] * dp
    every = ",".join(devs) if on_gpu else "cpu"
    plan = {
        "1": dict(data_parallel_size=1, dp_devices=(devs[0],)),
        "1ng": dict(data_parallel_size=1, dp_devices=(devs[0],), cuda_graph=False),
        "dp": dict(data_parallel_size=dp, dp_devices=tuple(devs)),
        "tp": dict(data_parallel_size=1, dp_devices=(every,), tensor_parallel_size=dp),
        "pp1": dict(data_parallel_size=1, dp_devices=(every,), pipeline_parallel_size=dp,
                    pp_micro_batches=1, cuda_graph=False),
        "ppN": dict(data_parallel_size=1, dp_devices=(every,), pipeline_parallel_size=dp,
                    pp_micro_batches=dp, cuda_graph=False),
    }
    names = {"1": "1 GPU" if on_gpu else "1 engine", "1ng": "1 GPU, no CUDA graphs",
             "dp": f"DP={dp}", "tp": f"TP={dp}",
             "pp1": f"PP={dp} (1 micro-batch)", "ppN": f"PP={dp} ({dp} micro-batches)"}
    rows = []
    for key in layouts:
        kw = dict(engine_kw, **plan[key])
        if on_gpu and key in ("1", "dp", "tp"):
            kw.setdefault("cuda_graph", True)
        if on_gpu:
            wait_for_free_gpus(gpus)
        rows.append(run_layout(names[key], factory, prompts, max_tokens, **kw))
        r = rows[-1]
        print(f"  {r['layout']}: {r['tok_s']:,.0f} tok/s ({r['seconds']:.1f} s, started in "
              f"{r['startup_s']:.0f} s)", flush=True)
    base = rows[0]
    for r in rows:
        r["vs_1"] = r["tok_s"] / base["tok_s"]
        r["same_tokens"] = r["tokens"] == base["tokens"]
    model = "Llama-3.2-1B shape, random bf16 weights" if on_gpu else "course model fp32"
    device = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    return {"model": model, "device": device, "gpus": gpus, "num_seqs": num_seqs,
            "min_in": min_in, "max_in": max_in, "min_out": min_out, "max_out": max_out,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}


def format_dp(r: dict) -> str:
    lines = [f"{r['model']} on {r['device']}: {r['num_seqs']} sequences, prompts "
             f"{r['min_in']}..{r['max_in']}, outputs {r['min_out']}..{r['max_out']} tokens"]
    for row in r["rows"]:
        lines.append(f"  {row['layout']:<26} {row['tok_s']:>10,.0f} tok/s  {row['vs_1']:5.2f}x"
                     f"  ({row['seconds']:.1f} s; same tokens as 1: {row['same_tokens']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m layer5_parallel.bench.dp")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-in", type=int, default=1024)
    ap.add_argument("--max-out", type=int, default=1024)
    ap.add_argument("--layouts", default="1,dp,tp,pp1,ppN")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.dp < 1 or args.num_seqs < 1 or args.max_in < 1 or args.max_out < 1:
        ap.error("--dp, --num-seqs, --max-in and --max-out must be >= 1")
    r = bench_dp(args.dp, num_seqs=args.num_seqs, max_in=args.max_in, max_out=args.max_out,
                 layouts=tuple(args.layouts.split(",")))
    print(format_dp(r), flush=True)
    if args.out:
        args.out.write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
