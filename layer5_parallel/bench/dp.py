"""Data parallelism against one GPU and against tensor and pipeline parallelism on the same GPUs.

    python -m layer5_parallel.bench.dp --dp 4 --out dp.json     # on a machine with 4 GPUs

nano-vllm's workload: 256 sequences of random token ids, prompts of 100..1024 tokens,
100..`--max-out` new tokens each (ignore_eos), on a Llama-3.2-1B-shaped model (`--shape
llama-3.1-8b`: the 8B shape, whose step is GPU-bound) with random bf16 weights drawn on
each GPU from one seed (said so; a CPU gets the course model and a small workload), kernels
of `--backend` (triton: layer 1's fused kernels, what the GPU benchmarks run; torch: plain
PyTorch, some 50 small kernels a layer, each paid even inside a CUDA graph). Each layout
runs in processes of its own (a `ReplicaSet`, so every layout pays the same overheads),
after a warm-up, timed from this process around one `generate`:

    1 GPU        one engine (1ng: without CUDA graphs, as the pipeline runs)
    DP=N         N engines, one per GPU, each its `hands` share of the sequences
    hand         one engine on one GPU running what DP=N's replica 0 runs: its tokens must
                 equal that replica's (nothing crosses between replicas), and its time is
                 that replica's without N-1 neighbours (contention for the host, the PCIe)
    weak         DP=N over N x the sequences (N x 256): the replicas each as loaded as 1 GPU
    TP=N         one engine over N GPUs (every layer split)
    PP=N         one engine over N GPUs (the layers cut into stages), micro-batches 1 and N
                 (pp1, ppN); pp2: PP=2 with 2 micro-batches on GPUs 0 and 1; a "g" after
                 any of them (ppNg): each stage's decode micro-batches from CUDA graphs; an
                 "f" after that (pp1f, pp2gf): as many steps in flight as stages, each over
                 its own group of the sequences (pp_steps_in_flight; the pipeline does not
                 drain every step: pipeline_parallel/in_flight.py), one micro-batch a step;
                 "F": one step more in flight than stages (slack for rank 0's host)
A layout may name its kernels: "dp:torch".

Reported: output tokens/s, each as a ratio to the first layout; whether the greedy tokens
equal its (else how many sequences differ and the first differing position: a batch of a
different size takes other GEMM tilings, so bf16 rounds differently and a near-tie of
random weights' flat logits may flip); and per engine process (replica) its sequences,
prompt and output tokens, steps, seconds, ms per step and the host's share of a step
(step() time minus the waits for a launched step's tokens: `StepClock`), so a run says
where its time went. DP=N's tokens/s cannot exceed N x 1 GPU's and reach it only when a
replica's step costs a quarter of one GPU's: every replica still runs ~max-out steps (the
longest output), at a quarter of the batch; a step's fixed cost (the weights read once,
the host's work, small kernels) is not divided.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

import layer4_algorithms as engine

from ..data_parallel.replicas import ReplicaSet, hands
from ..runtime.random_source import random_net
from .tp import workload
from .tp_gpu_bench import SHAPES

l3 = engine.executor


def llama(device: str, backend: str = "triton", shape: str = "llama-3.2-1b") -> l3.Model:
    """A model of `shape` (SHAPES; Llama-3.2-1B's by default) with random bf16 weights drawn
    on `device` from seed 0 (every replica, every pipeline rank, draws the same ones:
    runtime/random_source.py)."""
    config = l3.ModelConfig.from_dict(SHAPES[shape])
    return l3.Model(random_net(config, backend=backend, dtype=torch.bfloat16, device=device))


def course(device: str, backend: str = "torch") -> l3.Model:
    return l3.load(l3.course_model_dir("target"), backend=backend, dtype="float32",
                   device=device)


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


def differences(want: list[list[int]], got: list[list[int]]) -> dict:
    """How `got` differs from `want`, sequence by sequence: how many differ, and the first
    differing position (the earliest, and the median over the sequences that differ)."""
    firsts = []
    for a, b in zip(want, got, strict=True):
        if a != b:
            n = min(len(a), len(b))
            firsts.append(next((i for i in range(n) if a[i] != b[i]), n))
    return {"same_tokens": not firsts, "seqs_differ": len(firsts),
            "first_difference": min(firsts) if firsts else None,
            "median_first_difference": statistics.median(firsts) if firsts else None}


def run_layout(name: str, factory, prompts, max_tokens: list[int], *, warmup: list,
               timeout_s: float = 600.0, **sizes) -> dict:
    """One layout in processes of its own: warm up on `warmup` (prompts sharing no prefix with
    the workload's: a warm-up prompt left in one replica's prefix cache would spare it that
    prefill, and change its numerics, in the timed run), then time one generate of every
    prompt."""
    start = time.perf_counter()
    with ReplicaSet(factory, timeout_s=timeout_s, **sizes) as llm:
        ready_s = time.perf_counter() - start
        # prefill and decode shapes, kernels JIT-compiled, untimed
        llm.generate(warmup, l3.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        params = [l3.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                  for m in max_tokens]
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        stats = getattr(llm, "replica_stats", None) or {}
    tokens = [o.outputs[0].token_ids for o in outs]
    n = sum(map(len, tokens))
    return {"layout": name, "sizes": {k: v for k, v in sizes.items() if k != "dp_devices"},
            "devices": list(sizes.get("dp_devices") or ()), "seconds": wall,
            "output_tokens": n, "tok_s": n / wall, "startup_s": ready_s,
            "replicas": [dict(stats[i], replica=i) for i in sorted(stats)], "tokens": tokens}


def bench_dp(dp: int = 2, *, num_seqs: int = 256, max_in: int = 1024, max_out: int = 1024,
             layouts: tuple[str, ...] = ("1", "dp", "hand", "tp", "pp1", "ppN"), seed: int = 0,
             backend: str | None = None, timeout_s: float = 600.0, hand_of: int | None = None,
             budget_s: float | None = None, out: Path | None = None,
             shape: str = "llama-3.2-1b", **engine_kw) -> dict:
    """Every layout in `layouts` (see the module docstring; "key:backend" names a layout's
    kernels, else `backend`: triton on GPUs, torch on a CPU) on the same workload; rows and
    ratios to the first. hand_of: the DP size whose replica-0 share "hand" runs (default dp;
    on one GPU, --dp 1 --hand-of 4 asks what DP=4's replicas could reach: 1 GPU's seconds
    over the hand's, "dp_ceiling"). A layout that fails (or whose replicas do not answer
    within timeout_s) is listed under "failed" and the others still run; past budget_s
    seconds no layout starts ("skipped"). out: the results so far written there after each
    layout (a run cut short still leaves them)."""
    gpus = torch.cuda.device_count()
    on_gpu = gpus >= dp
    backend = backend or ("triton" if on_gpu else "torch")
    vocab = 128256 if on_gpu else 2048
    if not on_gpu:  # a CPU: the course model, a workload that finishes
        num_seqs, max_in, max_out = min(num_seqs, 8), min(max_in, 32), min(max_out, 16)
    min_in, min_out = min(100, max_in), min(100, max_out)

    def draw(n: int) -> tuple[list[list[int]], list[int]]:
        g = torch.Generator().manual_seed(seed + 1)
        return (workload(n, vocab, min_in, max_in, seed),
                torch.randint(min_out, max_out + 1, (n,), generator=g).tolist())

    prompts, max_tokens = draw(num_seqs)
    warmup = workload(min(num_seqs, 32), vocab, min_in, max_in, seed + 7919)
    devs = [str(i) for i in range(dp)] if on_gpu else ["cpu"] * dp
    every = ",".join(devs) if on_gpu else "cpu"
    hand_of = hand_of or dp
    hand0 = hands(prompts, [l3.SamplingParams(max_tokens=m) for m in max_tokens], hand_of)[0]
    plan = {
        "1": dict(data_parallel_size=1, dp_devices=(devs[0],)),
        "1ng": dict(data_parallel_size=1, dp_devices=(devs[0],), cuda_graph=False),
        "dp": dict(data_parallel_size=dp, dp_devices=tuple(devs)),
        "hand": dict(data_parallel_size=1, dp_devices=(devs[0],)),
        "weak": dict(data_parallel_size=dp, dp_devices=tuple(devs)),
        "tp": dict(data_parallel_size=1, dp_devices=(every,), tensor_parallel_size=dp),
        "pp1": dict(data_parallel_size=1, dp_devices=(every,), pipeline_parallel_size=dp,
                    pp_micro_batches=1, cuda_graph=False),
        "ppN": dict(data_parallel_size=1, dp_devices=(every,), pipeline_parallel_size=dp,
                    pp_micro_batches=dp, cuda_graph=False),
        "pp2": dict(data_parallel_size=1, dp_devices=("0,1" if on_gpu else "cpu",),
                    pipeline_parallel_size=2, pp_micro_batches=2, cuda_graph=False),
    }
    for key in ("pp1", "ppN", "pp2"):  # each stage's decode micro-batches from CUDA graphs
        plan[key + "g"] = dict(plan[key], cuda_graph=True)
    for key in [k for k in plan if k.startswith("pp")]:  # as many steps in flight as stages
        stages = plan[key]["pipeline_parallel_size"]      # (F: one more), one micro-batch each
        plan[key + "f"] = dict(plan[key], pp_micro_batches=1, pp_steps_in_flight=stages)
        plan[key + "F"] = dict(plan[key], pp_micro_batches=1, pp_steps_in_flight=stages + 1)
    one = "1 GPU" if on_gpu else "1 engine"
    names = {"1": one, "1ng": f"{one}, no CUDA graphs",
             "dp": f"DP={dp}", "hand": f"{one}, DP={hand_of}'s replica 0 hand",
             "weak": f"DP={dp}, {dp}x the sequences", "tp": f"TP={dp}",
             "pp1": f"PP={dp} (1 micro-batch)", "ppN": f"PP={dp} ({dp} micro-batches)",
             "pp2": "PP=2 (2 micro-batches)"}
    names.update({k + "g": names[k] + ", stage graphs" for k in ("pp1", "ppN", "pp2")})
    names.update({k + f: f"PP={plan[k]['pipeline_parallel_size']}, "
                  f"{plan[k + f]['pp_steps_in_flight']} steps in flight"
                  + (", stage graphs" if k.endswith("g") else "")
                  for k in list(names) if k.startswith("pp") for f in "fF"})
    unknown = [x for x in layouts if x.partition(":")[0] not in plan]
    if unknown:
        raise ValueError(f"unknown layout(s) {', '.join(unknown)}: expected {', '.join(plan)}")
    rows, by_key, failed, skipped = [], {}, [], []
    model = f"{shape} shape, random bf16 weights" if on_gpu else "course model fp32"
    device = torch.cuda.get_device_name(0) if on_gpu else "cpu"

    def result() -> dict:
        """The rows so far, each compared with the first."""
        base = rows[0] if rows else None
        for r in rows:
            comparable = r["key"] not in ("hand", "weak") and base["key"] not in ("hand", "weak")
            r["vs_1"] = r["tok_s"] / base["tok_s"] if r["key"] != "hand" else None
            r.update(differences(base["tokens"], r["tokens"]) if comparable else
                     {"same_tokens": None})
            if r["key"] == "hand":  # 1 GPU's time over the hand's: DP's best, replicas alike
                single = by_key.get("1" if r["backend"] == backend else f"1:{r['backend']}")
                if single is not None:
                    r["dp_ceiling"] = single["seconds"] / r["seconds"]
                # against DP's replica 0 (same kernels), when DP ran
                twin = by_key.get("dp" if r["backend"] == backend else f"dp:{r['backend']}")
                if twin is not None and hand_of == dp:
                    r["same_as_dp_replica_0"] = r["tokens"] == [twin["tokens"][k] for k in hand0]
        return {"model": model, "device": device, "gpus": gpus, "num_seqs": num_seqs,
                "min_in": min_in, "max_in": max_in, "min_out": min_out, "max_out": max_out,
                "backend": backend, "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d"),
                "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
                "failed": failed, "skipped": skipped}

    started = time.monotonic()
    for layout in layouts:
        if budget_s is not None and time.monotonic() - started > budget_s:
            skipped.append(layout)
            print(f"  {layout}: skipped (past the {budget_s:g} s budget)", flush=True)
            continue
        key, _, kernels = layout.partition(":")
        kernels = kernels or backend
        kw = dict(engine_kw, **plan[key])
        if on_gpu and key in ("1", "dp", "hand", "weak", "tp"):
            kw.setdefault("cuda_graph", True)
        if on_gpu:
            wait_for_free_gpus(gpus)
        factory = functools.partial(llama, backend=kernels, shape=shape) if on_gpu else \
            functools.partial(course, backend=kernels)
        ps, mt = prompts, max_tokens
        if key == "hand":
            ps, mt = [prompts[k] for k in hand0], [max_tokens[k] for k in hand0]
        elif key == "weak":
            ps, mt = draw(num_seqs * dp)
        name = names[key] + (f" [{kernels}]" if kernels != backend else "")
        print(f"  {name}: starting ({len(ps)} sequences)", flush=True)
        try:
            r = run_layout(name, factory, ps, mt, warmup=warmup, timeout_s=timeout_s, **kw)
        except Exception as exc:  # one layout failing keeps the others' rows
            failed.append({"layout": name, "error": f"{type(exc).__name__}: {exc}"})
            print(f"  {name}: FAILED {failed[-1]['error']}", flush=True)
            continue
        r["key"], r["backend"] = key, kernels
        rows.append(r)
        by_key.setdefault(layout, r)
        print(f"  {r['layout']}: {r['tok_s']:,.0f} tok/s ({r['seconds']:.2f} s, started in "
              f"{r['startup_s']:.0f} s)", flush=True)
        for rep in r["replicas"]:
            print("    " + format_replica(rep), flush=True)
        if out is not None:
            out.write_text(json.dumps(result(), indent=2))
    if not rows:
        raise RuntimeError(f"every layout failed: {failed}")
    return result()


def format_replica(rep: dict) -> str:
    return (f"replica {rep['replica']} ({rep['device']}): {rep['sequences']} seqs, "
            f"{rep['prompt_tokens']:,} prompt + {rep['output_tokens']:,} output tokens, "
            f"{rep['steps']:,} steps, {rep['wall_s']:.2f} s ({rep['ms_per_step']:.2f} ms/step, "
            f"host {rep['host_ms_per_step']:.2f} ms/step, {rep['mean_batch']:.1f} tokens/step)")


def format_dp(r: dict) -> str:
    lines = [f"{r['model']} on {r['device']}: {r['num_seqs']} sequences, prompts "
             f"{r['min_in']}..{r['max_in']}, outputs {r['min_out']}..{r['max_out']} tokens, "
             f"{r['backend']} kernels"]
    for row in r["rows"]:
        ratio = f"{row['vs_1']:5.2f}x" if row.get("vs_1") is not None else "   -  "
        notes = []
        if row.get("dp_ceiling") is not None:
            notes.append(f"1 GPU's time / this: {row['dp_ceiling']:.2f}x = DP's ceiling")
        if row.get("same_as_dp_replica_0") is not None:
            notes.append(f"same tokens as DP's replica 0: {row['same_as_dp_replica_0']}")
        if notes:
            same = "; ".join(notes)
        elif row.get("same_tokens") is None:
            same = "other sequences"
        elif row["same_tokens"]:
            same = "same tokens as 1: True"
        else:
            same = (f"same tokens as 1: False, {row['seqs_differ']} sequences differ, first at "
                    f"{row['first_difference']} (median {row['median_first_difference']:g})")
        lines.append(f"  {row['layout']:<34} {row['tok_s']:>10,.0f} tok/s  {ratio}"
                     f"  ({row['seconds']:.2f} s; {same})")
        for rep in row.get("replicas", []):
            lines.append("      " + format_replica(rep))
    for f in r.get("failed", []):
        lines.append(f"  {f['layout']:<34} FAILED: {f['error']}")
    if r.get("skipped"):
        lines.append(f"  skipped (time budget): {', '.join(r['skipped'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m layer5_parallel.bench.dp")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-in", type=int, default=1024)
    ap.add_argument("--max-out", type=int, default=1024)
    ap.add_argument("--layouts", default="1,dp,hand,tp,pp1,ppN",
                    help="comma-separated: 1, 1ng, dp, hand, weak, tp, pp1, ppN, pp2 (ppNg...: "
                         "stage graphs); "
                         "key:backend names a layout's kernels (dp:torch)")
    ap.add_argument("--backend", default=None, choices=("torch", "triton"),
                    help="the layouts' kernels (default: triton on GPUs, torch on a CPU)")
    ap.add_argument("--hand-of", type=int, default=None,
                    help="the DP size whose replica-0 share the 'hand' layout runs (default --dp)")
    ap.add_argument("--layout-timeout", type=float, default=600.0,
                    help="seconds a layout's replicas may take to answer (start, warm-up, run)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no layout past this many seconds (the rest are listed skipped)")
    ap.add_argument("--shape", default="llama-3.2-1b", choices=tuple(SHAPES),
                    help="the model's shape on GPUs (random bf16 weights; a CPU runs the course "
                         "model)")
    ap.add_argument("--out", type=Path, default=None,
                    help="results as JSON, rewritten after each layout")
    args = ap.parse_args(argv)
    if args.dp < 1 or args.num_seqs < 1 or args.max_in < 1 or args.max_out < 1:
        ap.error("--dp, --num-seqs, --max-in and --max-out must be >= 1")
    if args.layout_timeout <= 0:
        ap.error("--layout-timeout must be > 0")
    if args.hand_of is not None and args.hand_of < 1:
        ap.error("--hand-of must be >= 1")
    if args.budget_s is not None and args.budget_s <= 0:
        ap.error(f"--budget-s {args.budget_s:g}: seconds > 0 (no layout would start)")
    try:
        r = bench_dp(args.dp, num_seqs=args.num_seqs, max_in=args.max_in, max_out=args.max_out,
                     layouts=tuple(args.layouts.split(",")), backend=args.backend,
                     timeout_s=args.layout_timeout, hand_of=args.hand_of,
                     budget_s=args.budget_s, out=args.out, shape=args.shape)
    except ValueError as exc:  # an unknown layout
        ap.error(str(exc))
    print(format_dp(r), flush=True)
    if args.out:
        args.out.write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
