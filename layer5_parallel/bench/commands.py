"""Layer 5's commands for the `stack` CLI (entry point `llm_stack.layers` "5").

`run`: the course model generates through the engine at TP=1 (layer 4's engine, this process)
and at TP=N (gloo ranks on a CPU, NCCL on GPUs); prints whether the greedy tokens agree, what
each rank holds and the share of the step spent in collectives. `run --pp N [--tp T]`: the
same for pipeline parallelism (each stage T ranks), each rank's busy share against the bubble.
`bench`: what this machine allows: TP=1 vs layer 4 on one workload, TP=N vs TP=1 with the
planner's prediction beside the measurement, PP=2 vs PP=1 (its overlap against the bubble,
a timeline PNG), on 2+ GPUs data vs tensor vs pipeline parallelism (dp.py), then the other
layer-5 benchmarks (training, expert and context parallelism).
`plan`: the planner (`stack plan --model M --gpus N`).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import layer4_algorithms as engine

from .. import planner
from .dp import bench_dp, format_dp
from .expert_context import bench_expert_context, format_expert_context
from .pp import bench_pp, format_pp
from .tp import bench_tp, bench_tp1_vs_layer4
from .training import bench_training, format_training

TITLE = "tensor, pipeline, data, expert and context parallelism; ZeRO; planner"
console = Console()
if not console.is_terminal:
    console = Console(width=160)


def _mib(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def _device(name: str, tp: int) -> str:
    if name != "auto":
        return name
    return "cuda" if torch.cuda.device_count() >= tp else "cpu"


def _memory_table(rows: list[dict]) -> Table:
    t = Table(title="per rank (MiB)")
    for col in ("rank", "weights", "KV cache"):
        t.add_column(col, justify="right")
    for m in rows:
        t.add_row(str(m["rank"]), _mib(m["weights"]), _mib(m["kv"]))
    return t


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="stack run --layer 5", description="tensor-parallel generation vs one process"
    )
    ap.add_argument("--tp", type=int, default=None,
                    help="tensor-parallel size (course model: 2 or 6; default 2, or 1 with --pp)")
    ap.add_argument(
        "--device", default="auto", help="cpu (gloo ranks) or cuda (NCCL, one GPU per rank)"
    )
    ap.add_argument(
        "--tp-backend",
        choices=("torch", "ours"),
        default="torch",
        help="collectives: torch.distributed, or layer 2's own ring/tree",
    )
    ap.add_argument("--pp", type=int, default=1,
                    help="pipeline-parallel size: PP=N vs PP=1 (course model: 2..6); with --tp T "
                    "each stage is T ranks (TP x PP)")
    ap.add_argument("--steps-in-flight", type=int, default=1,
                    help="with --pp: steps kept in flight, each over its own group of the "
                    "sequences (pp_steps_in_flight; 1: every step drains the pipeline)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    if args.pp != 1:
        return _run_pp(args)
    args.tp = 2 if args.tp is None else args.tp
    if args.tp < 2:
        raise ValueError(f"--tp must be >= 2 to compare with TP=1, got {args.tp}")
    device = _device(args.device, args.tp)
    console.print(
        f"[dim]course model (fp32) on {device}: TP=1 in this process vs TP={args.tp} "
        f"({'NCCL' if device.startswith('cuda') else 'gloo'} ranks, "
        f"{args.tp_backend} collectives), {args.prompts} prompts x {args.max_tokens} "
        "greedy tokens[/]"
    )
    r = bench_tp(
        args.tp,
        device,
        tp_backend=args.tp_backend,
        num_prompts=args.prompts,
        max_tokens=args.max_tokens,
    )
    same = "[green]identical[/]" if r["same_tokens"] else "[yellow]differ (see near-ties)[/]"
    console.print(f"greedy tokens TP={args.tp} vs TP=1: {same}")
    console.print(_memory_table(r["memory"]))
    console.print(
        f"tokens/s: TP=1 {r['tp1_tok_s']:,.0f}, TP={args.tp} {r['tp_tok_s']:,.0f} "
        f"(x{r['speedup']:.2f}); mean step {r['step_ms']:.2f} ms over {r['steps']} steps, "
        f"{r['comm_share']:.0%} of it inside collectives "
        f"({r['collectives_per_step']:.0f} per step, "
        f"{r['comm_bytes_per_step'] / 1024:,.1f} KiB per step on rank 0)"
    )
    if device == "cpu":
        console.print(
            "[dim]On a CPU the ranks share the same cores and memory bus, so TP adds "
            "communication without adding bandwidth: expect a slow-down here; on GPUs "
            "each rank brings its own HBM.[/]"
        )
    return 0


def _run_pp(args: argparse.Namespace) -> int:
    """`stack run --layer 5 --pp N`: the pipelined engine vs one process (pp.py)."""
    if args.pp < 2:
        raise ValueError(f"--pp must be >= 2 to compare with PP=1, got {args.pp}")
    tp = args.tp or 1
    device = _device(args.device, args.pp * tp)
    what = f"PP={args.pp}" + (f" x TP={tp}" if tp > 1 else "")
    console.print(f"[dim]course model (fp32) on {device}: PP=1 in this process vs {what} "
                  f"({'NCCL' if device.startswith('cuda') else 'gloo'} ranks)[/]")
    r = bench_pp(args.pp, device, num_prompts=args.prompts, max_tokens=args.max_tokens, tp=tp,
                 steps_in_flight=args.steps_in_flight)
    console.print(format_pp(r))
    console.print(_memory_table(r["memory"]))
    return 0


def results_dir() -> Path:
    path = Path(os.environ.get("LLM_STACK_RESULTS") or "results") / "layer5"
    path.mkdir(parents=True, exist_ok=True)
    return path


def bench(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="stack bench --layer 5", description="layer 5's benchmarks")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="smaller workloads (a smoke test)")
    ap.add_argument("--no-training", action="store_true",
                    help="skip the other layer-5 benches (training, expert/context parallelism)")
    args = ap.parse_args(argv)
    device = (
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    results: dict = {}
    console.rule("TP=1 through layer 5 vs layer 4's engine")
    r = bench_tp1_vs_layer4(device, repeats=1 if args.quick else 3)
    results["tp1_vs_layer4"] = r
    console.print(
        f"{r['model']} on {device}, {r['prompts']} prompts x {r['max_tokens']} tokens: "
        f"layer 4 {r['layer4_tok_s']:,.0f} tok/s, layer 5 TP=1 {r['layer5_tp1_tok_s']:,.0f} "
        f"tok/s: ratio {r['ratio']:.3f} (target >= 0.97); same tokens: {r['same_tokens']}"
    )
    tp_device = "cuda" if torch.cuda.device_count() >= args.tp else "cpu"
    console.rule(f"TP={args.tp} vs TP=1 ({tp_device})")
    r = bench_tp(args.tp, tp_device, num_prompts=4 if args.quick else 8)
    results["tp"] = r
    console.print(
        f"TP=1 {r['tp1_tok_s']:,.0f} tok/s, TP={args.tp} {r['tp_tok_s']:,.0f} tok/s; "
        f"same tokens: {r['same_tokens']}; mean step {r['step_ms']:.2f} ms, "
        f"{r['comm_share']:.0%} in collectives; planner's decode step "
        f"{r['predicted_step_ms']:.2f} ms (of it comm {r['predicted_comm_ms']:.2f} ms)"
    )
    if device == "cuda" and torch.cuda.device_count() >= 2:  # real shapes, graphs on every rank
        from .tp_gpu_bench import bench_tp_gpu, format_rows  # noqa: PLC0415

        console.rule("tensor parallelism on GPUs: Llama-3.2-1B and 3.1-8B shapes, random bf16")
        shapes = ["llama-3.2-1b"] if args.quick else ["llama-3.2-1b", "llama-3.1-8b"]
        r = bench_tp_gpu(shapes, results_dir(), repeats=1 if args.quick else 2,
                         tp_backends=("torch", "ours"))  # NCCL and layer 2's all-reduce
        results["tp_gpu"] = r
        console.print(format_rows(r["rows"]))
    pp_device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    console.rule(f"PP=2 vs PP=1 ({pp_device})")
    r = bench_pp(2, pp_device, num_prompts=8 if args.quick else 16, max_tokens=16,
                 timeline=results_dir() / "pp_engine_p2.png")
    results["pp"] = {k: v for k, v in r.items() if k != "memory"}
    console.print(format_pp(r))
    if device == "cuda" and torch.cuda.device_count() >= 2:  # replicas vs splitting the model
        gpus = 4 if torch.cuda.device_count() >= 4 else 2
        console.rule(f"data vs tensor vs pipeline parallelism on {gpus} GPUs (nano-vllm workload)")
        torch.cuda.empty_cache()  # the replicas size their KV pools from the free memory
        r = bench_dp(gpus, layouts=("1", "dp", "tp") if args.quick else ("1", "dp", "tp", "pp1"),
                     max_out=256 if args.quick else 1024)
        results["dp"] = r
        console.print(format_dp(r))
    if not args.no_training:
        results.update(_other_benches(args.quick))
    out = results_dir() / "bench.json"
    out.write_text(json.dumps(results, indent=2, default=str))
    console.print(f"[dim]wrote {out}[/]")
    return 0


def _other_benches(quick: bool) -> dict:
    """The other layer-5 benchmarks: training parallelism (pipeline, DDP, ZeRO: training.py)
    and expert/context parallelism (expert_context.py)."""
    console.rule("training parallelism (pipeline, DDP, ZeRO)")
    training = bench_training(results_dir(), quick=quick)
    console.print(format_training(training))
    console.rule("expert and context parallelism")
    ep_cp = bench_expert_context()
    console.print(format_expert_context(ep_cp))
    return {"training": training, "expert_context": ep_cp}


def plan(argv: list[str] | None = None) -> int:
    """`stack plan`: the user's mistakes -> one line and exit 2 (layer 0's rule; --device here
    names a GPU model, not a device of this machine, so it skips run_command's device check)."""
    return engine.run_command(lambda _: _plan(list(argv or [])), [])


def _plan(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="stack plan", description="pick a TP/PP/DP layout")
    ap.add_argument(
        "--model",
        required=True,
        help="checkpoint dir, course-target, or a shape: " + ", ".join(planner.SHAPES),
    )
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--device", default="h100", help=", ".join([*planner.DEVICES, "cpu"]))
    ap.add_argument("--batch", type=int, default=32, help="sequences decoding together")
    ap.add_argument("--context", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--dtype-bytes", type=int, default=2, help="2: bf16 weights and KV")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.context < 1:
        raise ValueError("--batch and --context must be >= 1")
    config, hw = planner.load_config(args.model), planner.hardware_for(args.device)
    work = dict(batch=args.batch, context=args.context, nbytes=args.dtype_bytes)
    best, why = planner.recommend(config, hw, args.gpus, **work)
    t = Table(
        title=f"{args.model} on {args.gpus} x {hw.name}: batch {args.batch}, context "
        f"{args.context} (per rank, GiB; decode step, ms)"
    )
    for col in ("tp", "pp", "dp", "weights", "KV", "activ.", "fits", "step ms", "comm %", "tok/s"):
        t.add_column(col, justify="right")
    for lay in sorted(
        planner.layouts(config, hw, args.gpus, **work), key=lambda x: -x.tokens_per_s
    ):
        gib = [f"{v / 2**30:.2f}" for v in (lay.weights, lay.kv, lay.activations)]
        mark = "*" if lay == best else ""
        t.add_row(
            f"{mark}{lay.tp}",
            str(lay.pp),
            str(lay.dp),
            *gib,
            "yes" if lay.memory <= 0.9 * hw.memory else "no",
            f"{lay.step_s * 1e3:.2f}",
            f"{lay.comm_share:.0%}",
            f"{lay.tokens_per_s:,.0f}",
        )
    console.print(t)
    console.print(f"recommended: tp={best.tp} pp={best.pp} dp={best.dp} — {why}")
    return 0
