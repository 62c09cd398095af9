"""Layer 0 — the hardware: what this machine is and how fast it can possibly go.

Introspection (``system_info``, ``detect_device``), vendor datasheets, correct timing
(``time_fn``: warm-up, CUDA events, median), microbenchmarks that measure this machine's
ceilings (copy bandwidth, matmul FLOP/s per dtype, launch latency, host<->device
bandwidth) and the roofline model built on them. Later layers call ``load_ceilings()``
to report their kernels as a fraction of what this chip actually reaches.

Commands: ``python -m layer0_hardware`` (demo), ``stack info``, ``stack bench --layer 0``.
"""
from .ceilings import Ceilings, ceilings_path, load_ceilings, measure_ceilings, save_ceilings
from .datasheet import DATASHEETS, AcceleratorSpec, match_datasheet
from .introspect import CPUInfo, GPUInfo, SystemInfo, detect_device, system_info
from .microbench import (
    copy_bandwidth,
    host_device_bandwidth,
    launch_latency,
    matmul_flops,
    memory_bandwidth,
)
from .outputs import results_dir
from .roofline import (
    RooflinePoint,
    arithmetic_intensity,
    attainable_flops,
    attention_decode_cost,
    classify_bound,
    matmul_cost,
    ridge_point,
    vector_add_cost,
)
from .timing import Timing, median_time, python_loop_ms, time_fn, timed_into
from .topology import Topology, parse_nvidia_smi_topo, read_topology
from .usage import UsageError, check_device, run_command

__all__ = [
    # introspection
    "detect_device", "CPUInfo", "GPUInfo", "SystemInfo", "system_info",
    "Topology", "parse_nvidia_smi_topo", "read_topology",
    # datasheets
    "AcceleratorSpec", "DATASHEETS", "match_datasheet",
    # timing
    "Timing", "median_time", "time_fn", "python_loop_ms", "timed_into",
    # microbenchmarks
    "copy_bandwidth", "memory_bandwidth", "host_device_bandwidth", "matmul_flops",
    "launch_latency",
    # ceilings
    "Ceilings", "measure_ceilings", "ceilings_path", "save_ceilings", "load_ceilings",
    # roofline
    "arithmetic_intensity", "ridge_point", "attainable_flops", "classify_bound",
    "vector_add_cost", "matmul_cost", "attention_decode_cost", "RooflinePoint",
    "plot_roofline",
    # outputs
    "results_dir",
    # commands: a user's mistake is one line and exit code 2, in every layer
    "UsageError", "check_device", "run_command",
]


def __getattr__(name: str):
    # plot_roofline on first use: matplotlib costs ~0.3 s in every process that imports this
    # package (each spawned rank, engine process and CLI run), and few of them plot.
    if name == "plot_roofline":
        from .roofline_plot import plot_roofline
        return plot_roofline
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
