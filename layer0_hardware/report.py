"""Rich tables for what layer 0 found and measured (printed by the demo and `info`)."""
from __future__ import annotations

from rich.table import Table

from .ceilings import Ceilings
from .datasheet import AcceleratorSpec
from .introspect import SystemInfo
from .roofline import RooflinePoint, attainable_flops, classify_bound
from .topology import Topology
from .units import fmt_bandwidth, fmt_bytes, fmt_count, fmt_flops, fmt_ratio, fmt_seconds


def cpu_table(info: SystemInfo) -> Table:
    cpu = info.cpu
    table = Table(title="CPU", show_header=False)
    table.add_row("model", cpu.model)
    table.add_row("cores", f"{cpu.physical_cores} physical, {cpu.logical_cores} logical")
    table.add_row("caches", ", ".join(f"{k} {v}" for k, v in cpu.caches.items()) or "unknown")
    table.add_row("memory", fmt_bytes(cpu.memory_bytes))
    return table


def gpu_table(info: SystemInfo) -> Table:
    table = Table(title="GPUs")
    for column in ("#", "name", "CC", "SMs", "memory", "L2", "SM clock", "mem clock", "bus"):
        table.add_column(column)
    for gpu in info.gpus:
        mhz = lambda v: "-" if v is None else f"{v} MHz"  # noqa: E731 - local formatter
        table.add_row(str(gpu.index), gpu.name, "{}.{}".format(*gpu.compute_capability),
                      str(gpu.sm_count), fmt_bytes(gpu.memory_bytes), fmt_bytes(gpu.l2_bytes),
                      mhz(gpu.sm_clock_mhz), mhz(gpu.memory_clock_mhz),
                      "-" if gpu.memory_bus_width_bits is None
                      else f"{gpu.memory_bus_width_bits} bit")
    if not info.gpus:
        table.caption = "no CUDA GPU visible: every layer runs on the CPU"
    return table


def versions_table(info: SystemInfo) -> Table:
    table = Table(title="software", show_header=False)
    for key in ("torch_version", "cuda_version", "driver_version", "nccl_version",
                "triton_version"):
        table.add_row(key.removesuffix("_version"), getattr(info, key) or "-")
    return table


def topology_table(topo: Topology) -> Table:
    table = Table(title="interconnect (nvidia-smi topo -m)")
    table.add_column("")
    for device in topo.devices:
        table.add_column(device)
    for a in topo.devices:
        table.add_row(a, *(topo.link(a, b) for b in topo.devices))
    return table


def datasheet_table(spec: AcceleratorSpec) -> Table:
    table = Table(title=f"datasheet: {spec.name}", show_header=False)
    table.add_row("memory bandwidth", fmt_bandwidth(spec.memory_bandwidth))
    for dtype, flops in spec.peak_flops.items():
        table.add_row(f"{dtype} dense", fmt_flops(flops))
    table.add_row("memory", fmt_bytes(spec.memory_bytes))
    table.add_row("interconnect", spec.interconnect)
    table.add_row("source", spec.source)
    return table


def system_tables(info: SystemInfo, spec: AcceleratorSpec | None) -> list[Table]:
    """Every table describing this machine, in print order."""
    tables = [cpu_table(info), gpu_table(info), versions_table(info)]
    if info.topology is not None:
        tables.append(topology_table(info.topology))
    if spec is not None:
        tables.append(datasheet_table(spec))
    return tables


def ceilings_table(c: Ceilings, spec: AcceleratorSpec | None) -> Table:
    """Measured ceilings next to the datasheet, with measured / datasheet."""
    table = Table(title=f"measured ceilings: {c.device_name}")
    for column in ("ceiling", "measured", "datasheet", "measured / datasheet"):
        table.add_column(column)
    ds_bw = spec.memory_bandwidth if spec else None
    table.add_row("memory bandwidth (best stream)", fmt_bandwidth(c.memory_bandwidth),
                  fmt_bandwidth(ds_bw) if ds_bw else "-",
                  fmt_ratio(c.memory_bandwidth / ds_bw) if ds_bw else "-")
    for dtype, flops in c.flops.items():
        ds = spec.peak_flops.get(dtype) if spec else None
        table.add_row(f"matmul {dtype}", fmt_flops(flops), fmt_flops(ds) if ds else "-",
                      fmt_ratio(flops / ds) if ds else "-")
    table.add_row("launch latency", fmt_seconds(c.launch_latency_s), "-", "-")
    for kind, bw in c.host_device_bandwidth.items():
        table.add_row(f"host {kind}", fmt_bandwidth(bw), "-", "-")
    return table


def points_table(points: list[RooflinePoint], c: Ceilings, dtype: str) -> Table:
    """Each point's cost, speed, bound and fraction of its roof (the ``dtype`` roof).

    A point above its roof is not fine: it means the ceiling was measured low (a busy
    machine) or the op ran from cache. It is shown in red and the caption says so."""
    peak = c.peak_flops(dtype)
    table = Table(title=f"operations on the roofline ({dtype} roof)")
    for column in ("op", "FLOPs", "bytes", "FLOP/B", "time", "achieved", "bandwidth",
                   "bound", "of roof"):
        table.add_column(column)
    above = []
    for p in points:
        fraction = p.achieved_flops / attainable_flops(p.intensity, peak, c.memory_bandwidth)
        if fraction > 1.0:
            above.append(p.name)
        table.add_row(p.name, fmt_count(p.flops), fmt_bytes(p.nbytes), f"{p.intensity:.3g}",
                      fmt_seconds(p.seconds), fmt_flops(p.achieved_flops),
                      fmt_bandwidth(p.achieved_bandwidth),
                      classify_bound(p.intensity, peak, c.memory_bandwidth),
                      f"[bold red]{fmt_ratio(fraction)}![/]" if fraction > 1.0
                      else fmt_ratio(fraction))
    if above:
        table.caption = (f"[red]above the measured roof: {', '.join(above)}. A ceiling bounds "
                         "what the machine does, so this one was measured low (other work "
                         "was running?) or the op ran from cache: re-measure on an idle "
                         "machine with `stack bench --layer 0`.[/]")
    return table


def bench_table(rows: list, title: str) -> Table:
    """Bench rows (``bench_suite.BenchRow``): value, datasheet, both ratios, reference."""
    table = Table(title=title)
    for column in ("op", "measured", "datasheet", "÷ datasheet", "÷ ceiling",
                   "ceiling (reference)"):
        table.add_column(column)
    fmt = {"B/s": fmt_bandwidth, "FLOP/s": fmt_flops, "s": fmt_seconds}
    for row in rows:
        show = fmt[row.unit]
        table.add_row(row.op, show(row.value), show(row.datasheet) if row.datasheet else "-",
                      fmt_ratio(row.of_datasheet), fmt_ratio(row.of_ceiling),
                      f"{row.reference}: {show(row.ceiling)}" if row.ceiling else row.reference)
    return table
