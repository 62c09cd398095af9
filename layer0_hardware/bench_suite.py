"""The full layer-0 benchmark: every microbenchmark, compared with the datasheet and with
the ceiling measured in the same run.

Each row says what it measured, the datasheet figure (if the vendor gives one), and the
*reference* it is judged against: the memory ceiling is the faster of a copy and an add
stream at the largest size (the one that surely misses every cache), the matmul ceiling is
the fastest dtype, host transfers are judged against PCIe's per-direction rate. Ceilings
are the fastest of repeated runs (microbench.py says why).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .ceilings import Ceilings, now_iso
from .datasheet import AcceleratorSpec
from .introspect import device_name, software_versions
from .microbench import (
    CPU_MATMUL_DTYPES,
    MATMUL_DTYPES,
    copy_bandwidth,
    host_device_bandwidth,
    launch_latency,
    matmul_flops,
    memory_bandwidth,
)
from .progress import steps_progress

MiB = 2**20
# PCIe x16 payload rate per direction, by generation (GB/s after 128b/130b encoding).
_PCIE_X16 = {3: 15.75e9, 4: 31.5e9, 5: 63.0e9, 6: 121.0e9}


@dataclass
class BenchRow:
    """One measurement. unit: 'B/s', 'FLOP/s' or 's'. ceiling: the same-run reference
    value that ``reference`` names (None when there is none)."""

    op: str
    value: float
    unit: str
    datasheet: float | None
    ceiling: float | None
    reference: str

    @property
    def of_datasheet(self) -> float | None:
        return self.value / self.datasheet if self.datasheet else None

    @property
    def of_ceiling(self) -> float | None:
        return self.value / self.ceiling if self.ceiling else None

    def to_dict(self) -> dict:
        return {"op": self.op, "value": self.value, "unit": self.unit,
                "datasheet": self.datasheet, "ratio_to_datasheet": self.of_datasheet,
                "ceiling": self.ceiling, "fraction_of_ceiling": self.of_ceiling,
                "reference": self.reference}


def pcie_per_direction(spec: AcceleratorSpec | None) -> float | None:
    """Per-direction PCIe x16 bytes/s named in the datasheet's interconnect text."""
    match = re.search(r"PCIe Gen(\d)", spec.interconnect) if spec else None
    return _PCIE_X16.get(int(match.group(1))) if match else None


def _copy_sizes(dev: torch.device, quick: bool) -> list[int]:
    if dev.type != "cuda":
        return [4 * MiB, 64 * MiB] if quick else [16 * MiB, 64 * MiB, 256 * MiB]
    sizes = [16 * MiB, 256 * MiB] if quick else [16 * MiB, 256 * MiB, 1024 * MiB, 4096 * MiB]
    free, _ = torch.cuda.mem_get_info(dev)
    # A copy needs src and dst; leave headroom for the allocator and other tenants.
    return [s for s in sizes if 2 * s < 0.8 * free] or sizes[:1]


def run_bench(dev: torch.device, spec: AcceleratorSpec | None, *, quick: bool = False,
              progress: bool = True) -> tuple[list[BenchRow], Ceilings]:
    """Measure everything; return the rows and the ceilings they define."""
    on_gpu = dev.type == "cuda"
    copy_sizes = _copy_sizes(dev, quick)
    dtypes = MATMUL_DTYPES if on_gpu else CPU_MATMUL_DTYPES
    n = (2048 if quick else 8192) if on_gpu else (1024 if quick else 2048)
    transfers = [(d, p) for d in ("h2d", "d2h") for p in (True, False)] if on_gpu else []
    host_bytes = (64 if quick else 256) * MiB
    steps = [*(f"copy {s // MiB} MiB" for s in copy_sizes), "memory ceiling",
             *(f"matmul {d}" for d in dtypes),
             "launch latency", *(f"{d} {'pinned' if p else 'pageable'}" for d, p in transfers)]

    copies: dict[int, float] = {}
    flops: dict[str, float] = {}
    host: dict[str, float] = {}
    with steps_progress(steps, enabled=progress, title="layer 0 bench") as advance:
        def step(fn: Callable[[], float]) -> float:
            value = fn()
            advance()
            return value

        for size in copy_sizes:
            copies[size] = step(lambda s=size: copy_bandwidth(dev, s))
        streams = step(lambda: memory_bandwidth(dev, max(copy_sizes)))
        for dtype in dtypes:
            try:
                flops[dtype] = step(lambda d=dtype: matmul_flops(d, n, dev, peak=True))
            except NotImplementedError:
                advance()  # fp8 without FP8 tensor cores: reported as absent, not as zero
        latency = step(lambda: launch_latency(dev))
        for direction, pinned in transfers:
            key = f"{direction}_{'pinned' if pinned else 'pageable'}"
            host[key] = step(lambda d=direction, p=pinned: host_device_bandwidth(p, d, host_bytes))

    bw_ceiling = max(streams, copies[max(copies)])  # the roof bounds every row below it
    top_dtype = max(flops, key=flops.get)
    ds_bw = spec.memory_bandwidth if spec else None
    rows = [BenchRow(f"copy {s // MiB} MiB (read+write)", v, "B/s", ds_bw, bw_ceiling,
                     f"best copy/add stream, {max(copies) // MiB} MiB")
            for s, v in copies.items()]
    rows += [BenchRow(f"matmul {d} n={n}", v, "FLOP/s",
                      spec.peak_flops.get(d) if spec else None, flops[top_dtype],
                      f"fastest dtype, {top_dtype}") for d, v in flops.items()]
    rows.append(BenchRow("launch latency (tiny add)", latency, "s", None, None, "-"))
    pcie = pcie_per_direction(spec)
    for key, v in host.items():
        direction = key.split("_")[0]
        pinned_best = host[f"{direction}_pinned"]
        rows.append(BenchRow(f"{key.replace('_', ' ')} {host_bytes // MiB} MiB", v, "B/s",
                             pcie, pinned_best, f"pinned {direction}"))
    ceilings = Ceilings(device_name=device_name(dev), device_type=dev.type,
                        memory_bandwidth=bw_ceiling, flops=flops, launch_latency_s=latency,
                        host_device_bandwidth=host, measured_at=now_iso(),
                        versions=software_versions())
    return rows, ceilings
