"""`stack bench --layer 1`: every kernel against its reference, on layer 0's roofline.

Each BenchCase (from bench_elementwise, bench_matmul, bench_cuda) is timed twice in the
same run — ours and the reference on the same inputs — with `triton.testing.do_bench`
(CUDA events, warm-up, L2 flushed between calls, median). A result is reported three ways:
achieved rate (GB/s for memory-bound cases, TFLOP/s for compute-bound ones), speed-up
over the reference (reference time / our time), and fraction of the measured ceiling
(copy bandwidth, or the measured matmul FLOP/s of the case's dtype).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from layer0_hardware import (
    Ceilings,
    RooflinePoint,
    load_ceilings,
    match_datasheet,
    plot_roofline,
    system_info,
)

from . import bench_cuda, bench_elementwise, bench_matmul
from .bench_case import BenchCase
from .cupy_support import cupy_available

GROUPS = {"elementwise": bench_elementwise, "matmul": bench_matmul, "cuda": bench_cuda}


@dataclass
class BenchResult:
    """One timed case. Times in seconds; rates in bytes/s and FLOP/s."""

    name: str
    reference_name: str
    ours_s: float
    reference_s: float
    flops: float
    nbytes: float
    roof: str  # "bandwidth" or a dtype such as "bf16"
    fraction_of_ceiling: float

    @property
    def speedup(self) -> float:
        return self.reference_s / self.ours_s

    @property
    def achieved(self) -> str:
        if self.roof == "bandwidth":
            return f"{self.nbytes / self.ours_s / 1e9:,.0f} GB/s"
        return f"{self.flops / self.ours_s / 1e12:,.1f} TFLOP/s"


def median_seconds(fn) -> float:
    """do_bench's median in seconds (it reports milliseconds)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def time_case(case: BenchCase, ceilings: Ceilings) -> BenchResult:
    ours, reference = median_seconds(case.ours), median_seconds(case.reference)
    if case.dtype is None:
        roof, fraction = "bandwidth", case.nbytes / ours / ceilings.memory_bandwidth
    else:
        roof, fraction = case.dtype, case.flops / ours / ceilings.peak_flops(case.dtype)
    return BenchResult(case.name, case.reference_name, ours, reference, case.flops,
                       case.nbytes, roof, fraction)


def run_cases(device: torch.device, groups: list[str], progress) -> list[BenchResult]:
    """Build each group's cases (freeing them before the next group) and time them."""
    ceilings = load_ceilings(device)
    results = []
    for group in groups:
        if group == "cuda" and not cupy_available():
            progress(f"skipping the CuPy group: {bench_cuda.__name__} needs CuPy")
            continue
        for case in GROUPS[group].bench_cases(device):
            progress(f"timing {case.name}")
            results.append(time_case(case, ceilings))
        torch.cuda.empty_cache()
    return results


def write_outputs(results: list[BenchResult], extras: dict, device: torch.device,
                  out: Path) -> dict[str, Path]:
    """bench.json (every number), bench.md (the table for BENCHMARKS.md), roofline.png."""
    ceilings = load_ceilings(device)
    info = system_info()
    header = {
        "device": ceilings.device_name,
        "torch": info.torch_version, "cuda": info.cuda_version, "triton": info.triton_version,
        "driver": info.driver_version, "measured_copy_bandwidth": ceilings.memory_bandwidth,
        "measured_flops": ceilings.flops,
    }
    rows = [{**asdict(r), "speedup": r.speedup, "achieved": r.achieved} for r in results]
    paths = {"json": out / "bench.json", "md": out / "bench.md", "png": out / "roofline.png"}
    paths["json"].write_text(json.dumps({**header, "results": rows, **extras}, indent=2))
    lines = ["| kernel | ours | reference | speed-up | of ceiling |", "|---|---|---|---|---|"]
    lines += [f"| {r.name} | {r.achieved} | {r.reference_name} | {r.speedup:.2f}x | "
              f"{r.fraction_of_ceiling:.0%} of {r.roof} |" for r in results]
    paths["md"].write_text("\n".join(lines) + "\n")
    points = [RooflinePoint(r.name, r.flops, r.nbytes, r.ours_s) for r in results]
    plot_roofline(ceilings, points, paths["png"], datasheet=match_datasheet(ceilings.device_name),
                  title=f"Layer 1 kernels on {ceilings.device_name}")
    return paths
