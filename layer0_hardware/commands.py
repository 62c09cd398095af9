"""Layer 0's commands for the `stack` CLI: `stack info`, `stack run --layer 0`,
`stack bench --layer 0` (and `python -m layer0_hardware` = run).

The CLI finds this module through the ``llm_stack.layers`` entry point and calls
``run(argv)``, ``bench(argv)`` or ``info(argv)``; each returns a process exit code. The CLI
runs every layer's commands through ``run_command`` (from usage.py, re-exported here), so a
user's mistake is one line and exit code 2 in every layer.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console

from .bench_suite import run_bench
from .ceilings import measure_ceilings, now_iso, save_ceilings
from .datasheet import AcceleratorSpec, match_datasheet
from .introspect import SystemInfo, detect_device, system_info
from .outputs import results_dir
from .points import measure_points, roof_dtype
from .report import bench_table, ceilings_table, points_table, system_tables
from .usage import check_device, run_command

__all__ = ["TITLE", "bench", "info", "run", "run_command"]

TITLE = "hardware"


def _parser(prog: str, description: str, *, quick_flag: bool, out: bool = True
            ) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    if out:
        parser.add_argument("--out", type=Path, default=None,
                            help="directory for results (default: $LLM_STACK_RESULTS/layer0 "
                                 "or ./results/layer0)")
    parser.add_argument("--device", default=None,
                        help="torch device to measure, e.g. cpu or cuda:0 (default: best)")
    if quick_flag:
        parser.add_argument("--quick", action="store_true",
                            help="small sizes: seconds instead of minutes")
    return parser


def _device(name: str | None) -> torch.device:
    if name is None:
        return detect_device()
    return check_device(name)


def _spec_for(info: SystemInfo, dev: torch.device) -> AcceleratorSpec | None:
    if dev.type != "cuda" or not info.gpus:
        return None
    gpu = info.gpus[dev.index or 0]
    return match_datasheet(gpu.name, gpu.memory_bytes)


def _console() -> Console:
    console = Console()
    # Piped output (CI logs, tests) defaults to 80 columns, which wraps every table cell.
    return console if console.is_terminal else Console(width=150)


def _out_dir(out: Path | None) -> Path:
    if out is None:
        return results_dir(0)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _start(prog: str, description: str, argv: list[str], *, quick_flag: bool):
    """What run and bench both begin with: the start time, parsed args, the device, the output
    folder, a console, the system description and its matched datasheet (None off a known
    GPU)."""
    started = time.perf_counter()
    args = _parser(prog, description, quick_flag=quick_flag).parse_args(argv)
    dev = _device(args.device)
    sysinfo = system_info()
    return started, args, dev, _out_dir(args.out), _console(), sysinfo, _spec_for(sysinfo, dev)


def info(argv: list[str]) -> int:
    """Print CPU, GPUs, software versions, topology and the matched datasheet."""
    args = _parser("stack info", info.__doc__, quick_flag=False, out=False).parse_args(argv)
    dev = _device(args.device)
    console = _console()
    sysinfo = system_info()
    for table in system_tables(sysinfo, _spec_for(sysinfo, dev)):
        console.print(table)
    console.print(f"device layers will use: [bold]{dev}[/bold]")
    return 0


def run(argv: list[str]) -> int:
    """Demo: describe the machine, measure quick ceilings, place ops on the roofline."""
    started, args, dev, out, console, sysinfo, spec = _start("stack run --layer 0", run.__doc__,
                                                              argv, quick_flag=False)
    for table in system_tables(sysinfo, spec):
        console.print(table)
    console.print(f"\nmeasuring [bold]{dev}[/bold] (quick sizes; `stack bench --layer 0` "
                  "for the full set)")
    ceilings = measure_ceilings(dev, quick=True, progress=True)
    console.print(ceilings_table(ceilings, spec))

    points = measure_points(dev, quick=True)
    dtype = roof_dtype(dev)
    console.print(points_table(points, ceilings, dtype))

    ceilings_json = out / "ceilings.json"
    ceilings_json.write_text(json.dumps(ceilings.to_dict(), indent=2) + "\n")
    # matplotlib (~0.75 s) only where a plot is drawn: every `stack` command loads this module
    from .roofline_plot import plot_roofline

    png = plot_roofline(ceilings, points, out / "roofline.png", datasheet=spec)
    cache = save_ceilings(ceilings)
    console.print(f"wrote {ceilings_json}\nwrote {png}\ncached ceilings at {cache}")
    console.print(f"done in {time.perf_counter() - started:.1f} s")
    return 0


def bench(argv: list[str]) -> int:
    """Full microbenchmarks vs datasheet and measured ceilings; writes bench.json."""
    started, args, dev, out, console, _, spec = _start("stack bench --layer 0", bench.__doc__,
                                                       argv, quick_flag=True)
    rows, ceilings = run_bench(dev, spec, quick=args.quick, progress=True)
    title = f"layer 0 bench: {ceilings.device_name}" + (f" vs {spec.name} datasheet"
                                                        if spec else " (no datasheet match)")
    console.print(bench_table(rows, title))
    points = measure_points(dev, quick=args.quick)
    console.print(points_table(points, ceilings, roof_dtype(dev)))

    report = {
        "device": ceilings.device_name, "device_type": dev.type,
        "datasheet": spec.name if spec else None, "quick": args.quick,
        "measured_at": now_iso(), "versions": ceilings.versions,
        "rows": [row.to_dict() for row in rows],
        "ceilings": ceilings.to_dict(),
        "points": [{"name": p.name, "flops": p.flops, "bytes": p.nbytes, "seconds": p.seconds,
                    "intensity": p.intensity, "achieved_flops": p.achieved_flops}
                   for p in points],
    }
    bench_json = out / "bench.json"
    bench_json.write_text(json.dumps(report, indent=2) + "\n")
    from .roofline_plot import plot_roofline  # (see run)

    png = plot_roofline(ceilings, points, out / "roofline.png", datasheet=spec)
    console.print(f"wrote {bench_json}\nwrote {png}")
    if args.quick:  # quick sizes under-fill a GPU: never let them overwrite real ceilings
        console.print("--quick: ceilings cache left unchanged")
    else:
        console.print(f"cached ceilings at {save_ceilings(ceilings)}")
    console.print(f"done in {time.perf_counter() - started:.1f} s")
    return 0
