"""Layer 2's commands for the `stack` CLI (entry point `llm_stack.layers` "2").

`run`: every collective of this layer on N ranks, checked exactly against
torch.distributed's built-in on integer-valued data and timed beside it.
`bench`: the nccl-tests-style sweep (ours vs built-in), a ping-pong fitted to the
alpha-beta model, predicted vs measured, the ring/tree crossover, and the overlap of an
all-reduce with matmuls.
`peer` (``stack bench --layer 2 --peer``, or ``python -m layer2_comm.commands peer``): our
one-shot / two-shot all-reduce over NVLink peer memory vs NCCL vs torch's symm_mem ops,
latency 8 B .. 2 MiB in CUDA graphs, busbw to 256 MiB, the choice table and crossovers.
`tune` (``python -m layer2_comm.commands tune``): the knobs of tuning.py measured — the
ring step's bandwidth per lane count, ours per (lanes, piece size), the header check's cost.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from layer1_kernels import hardware

from .bench_bandwidth import bench_rank, default_sizes, measured_crossover
from .bench_tuning import ONE_PIECE, tune_rank
from .checks import check_rank
from .cost_model import crossover, fit_alpha_beta, predict
from .group import MULTICAST_OFF, init
from .launch import launch
from .plots import human, markdown, plot_busbw, plot_predicted_vs_measured
from .tables import print_overlap, print_tables, print_tune

TITLE = "communication"
console = Console()
if not console.is_terminal:  # piped output (logs, tests) would wrap every cell at 80 columns
    console = Console(width=160)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _on_ranks(fn, world: int, *args, backend: str, timeout_s: float) -> list:
    """launch() the ranks here; under torchrun (multi-node) be one of them instead.

    Under torchrun only rank 0's value comes back (others get [None] and print nothing).
    """
    if _under_torchrun():
        init(backend, timeout_s=timeout_s)
        value = fn(*args)
        return [value if dist.get_rank() == 0 else None]
    return launch(fn, world, *args, backend=backend, timeout_s=timeout_s)


def _check_args(args: argparse.Namespace) -> None:
    """Values that cannot work, as one clear ValueError (the CLI prints it as one line)."""
    for name in ("world", "iters", "numel", "min_bytes", "max_bytes"):
        value = getattr(args, name, None)
        if value is not None and value < (0 if name == "numel" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be >= "
                             f"{0 if name == 'numel' else 1}, "
                             f"got {value}")
    if getattr(args, "factor", None) is not None and args.factor < 2:
        raise ValueError("--factor must be >= 2 (each size a multiple of "
                         f"the last), got {args.factor}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.backend == "nccl" and not _under_torchrun() and gpus < (args.world or 1):
        raise ValueError(f"--backend nccl needs a CUDA GPU per rank; {gpus} visible "
                         "(use --backend gloo on a CPU)")


def _world_and_backend(world: int | None, backend: str) -> tuple[int, str]:
    """Ranks and backend: torchrun's when under it; else every GPU with NCCL, or 4 gloo ranks."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if _under_torchrun():
        console.quiet = os.environ["RANK"] != "0"  # one rank reports
        if backend == "auto":
            backend = "nccl" if gpus else "gloo"
        return int(os.environ["WORLD_SIZE"]), backend
    if backend == "auto":
        backend = "nccl" if gpus >= 2 and (world or gpus) <= gpus else "gloo"
    return world or (gpus if backend == "nccl" else 4), backend


def _gpu_links(topology) -> dict[str, str] | None:
    """nvidia-smi's link type between each pair of GPUs ("NV18", "PIX", "SYS", ...)."""
    if topology is None:
        return None
    return {f"{a}-{b}": t for (a, b), t in topology.links.items()
            if a < b and a.startswith("GPU") and b.startswith("GPU")}


def _parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=doc)
    parser.add_argument("--world", type=int,
                        help="ranks (default: every GPU with NCCL, else 4 gloo ranks)")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    parser.add_argument("--iters", type=int, help="timed iterations per measurement")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds before stuck ranks are stopped")
    return parser


def run(argv: list[str] | None = None) -> int:
    """Run every collective on N ranks, check it against the built-in, and time both."""
    parser = _parser("stack run --layer 2", run.__doc__)
    parser.add_argument("--numel", type=int, default=1001,
                        help="elements per rank (odd on purpose)")
    args = parser.parse_args(argv or [])
    _check_args(args)
    world, backend = _world_and_backend(args.world, args.backend)
    console.print(f"[bold]Layer 2 — communication[/bold]: {world} ranks, {backend}, "
                  f"{args.numel} elements per rank")
    with console.status("ranks running..."):
        per_rank = _on_ranks(check_rank, world, args.numel, args.iters or 20, backend=backend,
                             timeout_s=args.timeout)
    if per_rank[0] is None:  # a non-zero torchrun rank: rank 0 reports
        return 0
    table = Table(title="each collective (from send/recv) vs torch.distributed, exact check; "
                        "median time of the slowest rank")
    table.add_column("collective", no_wrap=True)
    table.add_column("variant", overflow="fold")
    for column in ("ok", "ours ms", "torch ms", "ratio"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in per_rank[0]:
        table.add_row(r["collective"], r["detail"], "[green]yes" if r["ok"] else "[red]NO",
                      f"{r['ours_s'] * 1e3:.3f}", f"{r['torch_s'] * 1e3:.3f}",
                      f"{r['ours_s'] / r['torch_s']:.2f}x" if r["torch_s"] > 0 else "-")
    console.print(table)
    failed = [f"{r['collective']} ({r['detail']})" for r in per_rank[0] if not r["ok"]]
    if failed:
        console.print(f"[red]failed: {', '.join(failed)}")
    return 1 if failed else 0


def bench(argv: list[str] | None = None) -> int:
    """nccl-tests-style sweep of ours vs built-in; alpha-beta fit, predictions, plots."""
    parser = _parser("stack bench --layer 2", bench.__doc__)
    parser.add_argument("--max-bytes", type=int,
                        help="largest message (default 1 GiB with NCCL, 4 MiB on gloo)")
    parser.add_argument("--min-bytes", type=int, default=8)
    parser.add_argument("--factor", type=int, help="size step (default 2 with NCCL, 4 on gloo)")
    parser.add_argument("--out", type=Path, help="output folder (default results/layer2)")
    parser.add_argument("--no-overlap", action="store_true", help="skip the overlap measurement")
    parser.add_argument("--peer", action="store_true",
                        help="only the peer-memory all-reduce (ours vs NCCL vs torch symm_mem)")
    args = parser.parse_args(argv or [])
    _check_args(args)
    world, backend = _world_and_backend(args.world, args.backend)
    gpu = backend == "nccl"
    if args.peer:
        return peer(argv)
    sizes = default_sizes(args.max_bytes or (1 << 30 if gpu else 4 << 20), args.min_bytes,
                          args.factor or (2 if gpu else 4))
    iters = args.iters or (20 if gpu else 5)
    # The overlap measurement: its GPU defaults (256 MiB against 4096^2 matmuls), or a small
    # one on CPU.
    overlap = None if args.no_overlap else (
        {} if gpu else {"comm_bytes": 1 << 20, "matmul_n": 128, "iters": 3, "warmup": 1})
    console.print(f"[bold]Layer 2 bench[/bold]: {world} ranks, {backend}, {len(sizes)} sizes "
                  f"{sizes[0]} B .. {sizes[-1]:,} B, {iters} iterations each (fewer above 256 MiB)")
    with console.status("sweeping (every rank busy)..."):
        result = _on_ranks(bench_rank, world, sizes, iters, max(1, iters // 4), overlap,
                           backend=backend, timeout_s=args.timeout)[0]
    if result is None:
        return 0
    rows, ping, hidden = result["rows"], result["ping_pong"], result["overlap"]
    ab = fit_alpha_beta([p["bytes"] for p in ping], [p["time_s"] for p in ping])
    predicted = [
        {"algorithm": alg, "bytes": r["bytes"], "time_s": predict(alg, r["bytes"], world, ab)}
        for alg in ("ring_all_reduce", "tree_all_reduce")
        for r in rows
        if r["algorithm"] == alg
    ]
    model_x = crossover("ring_all_reduce", "tree_all_reduce", world, ab)
    measured_x = measured_crossover(rows)
    print_tables(console, rows, predicted)
    bw = (f"1/beta = {ab.bandwidth / 1e9:.2f} GB/s" if ab.beta_s_per_byte
          else "beta = 0 (time did not grow with size in this range)")
    console.print("alpha-beta from ping-pong (ranks 0<->1): alpha = "
                  f"{ab.alpha_s * 1e6:.1f} us, {bw}")
    console.print("ring/tree all-reduce crossover: predicted "
                  + (f"{model_x:,.0f} B" if model_x
                     else "none (tree wins at every size in the model)")
                  + ", measured " + (f"{measured_x:,} B" if measured_x else "none in this range"))
    out = args.out or hardware.results_dir(2)
    out.mkdir(parents=True, exist_ok=True)
    info = hardware.system_info()
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "world": world,
        "backend": backend,
        "device": info.gpus[0].name if gpu and info.gpus else info.cpu.model,
        "torch": info.torch_version,
        "nccl": info.nccl_version,
        "gpu_links": _gpu_links(info.topology) if gpu else None,
        "alpha_s": ab.alpha_s,
        "beta_s_per_byte": ab.beta_s_per_byte,
        "crossover_predicted_bytes": model_x,
        "crossover_measured_bytes": measured_x,
        "rows": rows,
        "predicted": predicted,
        "ping_pong": ping,
        "overlap": hidden,
    }
    if hidden is not None:
        print_overlap(console, hidden)
    if record["gpu_links"]:
        console.print(
            "GPU links (nvidia-smi topo -m): "
            + ", ".join(f"{k} {v}" for k, v in record["gpu_links"].items())
        )
    (out / "bench.json").write_text(json.dumps(record, indent=2, default=str))
    (out / "bench.md").write_text(markdown(rows, record))
    title = f"{world} ranks, {backend}"
    plot_predicted_vs_measured(
        [r for r in rows if r["impl"] == "ours" and "all_reduce" in r["algorithm"]],
        predicted,
        out / "time_vs_size.png",
        f"all-reduce time, {title}",
    )
    plot_busbw(rows, out / "busbw.png", f"bus bandwidth, {title}")
    for name in ("bench.json", "bench.md", "time_vs_size.png", "busbw.png"):
        console.print(f"wrote {out / name}")
    return 0 if all(r["ok"] for r in rows) and (hidden is None or hidden["correct"]) else 1


def peer(argv: list[str] | None = None) -> int:
    """Our peer-memory all-reduce vs NCCL vs torch symm_mem: tables, crossovers, JSON, plot."""
    from .bench_peer import BANDWIDTH_SIZES, LATENCY_SIZES, peer_bench_rank, summarize
    from .peer_report import (
        choice_table,
        crossover_lines,
        eager_lines,
        gather_scatter_table,
        knob_lines,
        latency_table,
        markdown,
        plot_peer_busbw,
    )

    parser = _parser("stack bench --layer 2 --peer", peer.__doc__)
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--max-bytes", type=int, default=BANDWIDTH_SIZES[-1],
                        help="largest bandwidth size (default 256 MiB)")
    parser.add_argument("--out", type=Path, help="output folder (default results/layer2)")
    args, _ = parser.parse_known_args(argv or [])
    _check_args(args)
    world, backend = _world_and_backend(args.world, args.backend)
    if backend != "nccl":
        raise ValueError("the peer all-reduce needs CUDA peer access: 2 or more GPUs with NCCL")
    for key, value in MULTICAST_OFF.items():  # NVLink SHARP off, as everywhere in this course
        os.environ.setdefault(key, value)
    iters = args.iters or 20
    bandwidth = [s for s in BANDWIDTH_SIZES if s <= args.max_bytes]
    console.print(f"[bold]Layer 2 peer all-reduce[/bold]: {world} ranks, bf16, latency "
                  f"{LATENCY_SIZES[0]} B .. 8 MiB in CUDA graphs, busbw "
                  f"to {bandwidth[-1] >> 20 if bandwidth else 0} MiB, {iters} iterations")
    with console.status("measuring (every rank busy)..."):
        result = _on_ranks(peer_bench_rank, world, LATENCY_SIZES, bandwidth, iters,
                           backend=backend, timeout_s=args.timeout)[0]
    if result is None:
        return 0
    rows = result["rows"]
    summary = summarize(rows, world)
    console.print(latency_table(rows))
    console.print(gather_scatter_table(rows))
    console.print(choice_table(summary))
    for line in crossover_lines(summary) + eager_lines(rows):
        console.print(line)
    for line in knob_lines(rows):
        console.print(line, markup=False, highlight=False)
    out = args.out or hardware.results_dir(2)
    out.mkdir(parents=True, exist_ok=True)
    info = hardware.system_info()
    record = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "world": world,
              "device": info.gpus[0].name if info.gpus else None, "torch": info.torch_version,
              "triton": _triton_version(), "nccl": info.nccl_version,
              "env": {k: os.environ.get(k) for k in MULTICAST_OFF}, "rows": rows,
              "summary": summary}
    (out / "peer_bench.json").write_text(json.dumps(record, indent=2, default=str))
    (out / "peer_bench.md").write_text(markdown(rows, summary))
    plot_peer_busbw(rows, out / "peer_busbw.png",
                    f"busbw, {world} x {record['device']}, bf16 (CUDA graphs up to 8 MiB)")
    for name in ("peer_bench.json", "peer_bench.md", "peer_busbw.png"):
        console.print(f"wrote {out / name}")
    checked = [r["ok"] for r in rows if r["impl"].startswith("ours") or r["impl"] == "NCCL"]
    return 0 if all(checked) else 1


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def tune(argv: list[str] | None = None) -> int:
    """Measure pieces, lanes and the header check at the sizes that matter (see bench_tuning.py)."""
    parser = _parser("python -m layer2_comm.commands tune", tune.__doc__)
    parser.add_argument("--sizes", default=None,
                        help="comma-separated bytes (default 67108864,268435456 "
                             "with NCCL, 4194304 on gloo)")
    parser.add_argument("--out", type=Path, help="output folder (default results/layer2)")
    args = parser.parse_args(argv or [])
    _check_args(args)
    world, backend = _world_and_backend(args.world, args.backend)
    gpu = backend == "nccl"
    sizes = (
        [int(s) for s in args.sizes.split(",")]
        if args.sizes
        else ([64 << 20, 256 << 20] if gpu else [4 << 20])
    )
    iters = args.iters or (10 if gpu else 3)
    lanes_grid, chunk_grid = ((1, 2, 4), (16 << 20, 32 << 20, 64 << 20, ONE_PIECE)) if gpu \
        else ((1, 2), (1 << 20, ONE_PIECE))  # a quick look on CPU
    console.print(f"[bold]Layer 2 tune[/bold]: {world} ranks, {backend}, sizes "
                  f"{[human(s) for s in sizes]}")
    with console.status("measuring (every rank busy)..."):
        result = _on_ranks(
            tune_rank,
            world,
            sizes,
            iters,
            max(1, iters // 3),
            lanes_grid,
            chunk_grid,
            backend=backend,
            timeout_s=args.timeout,
        )[0]
    if result is None:
        return 0
    print_tune(console, result)
    out = args.out or hardware.results_dir(2)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(
        json.dumps({"world": world, "backend": backend, **result}, indent=2, default=str)
    )
    console.print(f"wrote {out / 'tune.json'}")
    return 0 if all(r["ok"] for r in result["configs"] + result["check"]) else 1


# python -m layer2_comm.commands [run|bench|tune] [options]; torchrun too
if __name__ == "__main__":
    commands = {"run": run, "bench": bench, "tune": tune, "peer": peer}
    name = sys.argv[1] if sys.argv[1:2] and sys.argv[1] in commands else "run"
    sys.exit(commands[name](sys.argv[2:] if sys.argv[1:2] == [name] else sys.argv[1:]))
