"""Layer 1's commands for the `stack` CLI (entry point `llm_stack.layers` "1")."""
from __future__ import annotations

import argparse
import math

import torch
from rich.console import Console
from rich.table import Table

from layer0_hardware import UsageError, results_dir

from . import bench as benchmarks
from . import checks
from .interpreter import INTERPRETED

TITLE = "kernels"
console = Console()
if not console.is_terminal:  # piped output (logs, tests) would wrap every cell at 80 columns
    console = Console(width=160)


def run(argv: list[str]) -> int:
    """Run every kernel once on this machine against its float64 reference."""
    argparse.ArgumentParser(prog="stack run --layer 1", description=run.__doc__).parse_args(argv)
    where = "Triton's interpreter on the CPU" if INTERPRETED else torch.cuda.get_device_name()
    console.print(f"[bold]Layer 1 — kernels[/bold], running on {where}")
    results = checks.run_checks()
    table = Table(title="each kernel vs its torch reference (fresh random inputs, awkward sizes)")
    for column in ("kernel", "shape", "rel. error", "ok", "seconds"):
        table.add_column(column, overflow="fold")
    for r in results:
        ok = {True: "[green]yes", False: "[red]NO", None: "[yellow]skipped"}[r.ok]
        error = "-" if r.rel_error is None else f"{r.rel_error:.1e}"
        table.add_row(r.name, r.shape, error, ok, f"{r.seconds:.2f}")
    console.print(table)
    for r in results:
        if r.note:
            console.print(f"{r.name}: {r.note}")
    failed = [r.name for r in results if r.ok is False]
    if failed:
        console.print(f"[red]failed: {', '.join(failed)}")
    return 1 if failed else 0


def bench(argv: list[str]) -> int:
    """Time every kernel against its reference and place it on layer 0's roofline."""
    parser = argparse.ArgumentParser(prog="stack bench --layer 1", description=bench.__doc__)
    parser.add_argument(
        "--groups", nargs="+", choices=sorted(benchmarks.GROUPS), default=sorted(benchmarks.GROUPS)
    )
    parser.add_argument("--no-demos", action="store_true",
                        help="skip the SGEMM table, graph and stream demos")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():  # the CLI prints it as one line, exit code 2
        raise UsageError("layer 1's benchmarks time GPU kernels and need a CUDA GPU; none is "
                         "visible. `stack run --layer 1` checks every kernel on this CPU")
    device = torch.device("cuda")
    results = benchmarks.run_cases(device, args.groups, progress=lambda m: console.print(f"  {m}"))
    extras = {} if args.no_demos else _demos()
    paths = benchmarks.write_outputs(results, extras, device, results_dir(1))

    table = Table(title=f"Layer 1 on {torch.cuda.get_device_name()} (do_bench medians)")
    for column in ("kernel", "ours", "reference", "speed-up", "of ceiling"):
        table.add_column(column, overflow="fold")
    for r in results:
        table.add_row(r.name, r.achieved, r.reference_name, f"{r.speedup:.2f}x",
                      f"{r.fraction_of_ceiling:.0%} of {r.roof}")
    console.print(table)
    for name, path in paths.items():
        console.print(f"wrote {name}: {path}")
    return 0 if all(math.isfinite(r.ours_s) for r in results) else 1


def _demos() -> dict:
    """The SGEMM progression, CUDA graphs and streams, each printed and returned."""
    from .bench_cuda import sgemm_progression_table
    from .cupy_support import cupy_available
    from .graphs_streams import cuda_graph_demo, stream_overlap_demo

    extras: dict = {}
    if cupy_available():
        extras["sgemm_progression"] = rows = sgemm_progression_table()
        table = Table(title="SGEMM progression, 4096^3 fp32 (cuBLAS without TF32 = 1.0)")
        for column in rows[0]:
            table.add_column(str(column))
        for row in rows:
            table.add_row(*(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()))
        console.print(table)
    extras["cuda_graph"] = cuda_graph_demo()
    extras["stream_overlap"] = stream_overlap_demo()
    console.print("CUDA graph:", extras["cuda_graph"])
    console.print("stream overlap:", extras["stream_overlap"])
    return extras

