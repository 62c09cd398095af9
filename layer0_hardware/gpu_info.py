"""What GPUs are here? Properties from torch, clocks and driver from NVML or nvidia-smi.

torch.cuda.get_device_properties gives what the CUDA runtime knows (name, SM count,
memory, L2). Clocks, memory bus width and the driver version come from NVML (the
``pynvml`` module of the ``nvidia-ml-py`` package) when importable, else from
``nvidia-smi --query-gpu``, else they stay None. Nothing here needs a GPU to import.
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

import torch

try:  # optional: NVML bindings
    import pynvml
except ImportError:
    pynvml = None


@dataclass
class GPUInfo:
    """One CUDA device. memory_bytes and l2_bytes in bytes; clocks are the *maximum*
    SM / memory clocks in MHz; None where no source could tell."""

    index: int
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bytes: int
    l2_bytes: int
    sm_clock_mhz: int | None = None
    memory_clock_mhz: int | None = None
    memory_bus_width_bits: int | None = None


def _nvml_call(fn, *args):
    try:
        return fn(*args)
    except Exception:  # NVML raises its own error types; any failure means "unknown"
        return None


def _decode(value: object) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_details(uuid: str | None, index: int) -> dict[str, object]:
    """Clocks, bus width and driver from NVML; {} when NVML is unavailable."""
    if not _nvml_init():
        return {}
    # Prefer the UUID: NVML numbers devices by PCI order, CUDA may not (CUDA_VISIBLE_DEVICES).
    handle = _nvml_call(pynvml.nvmlDeviceGetHandleByUUID, uuid) if uuid else None
    if handle is None:
        handle = _nvml_call(pynvml.nvmlDeviceGetHandleByIndex, index)
    if handle is None:
        return {}
    bus_width = getattr(pynvml, "nvmlDeviceGetMemoryBusWidth", None)
    return {
        "sm_clock_mhz": _nvml_call(pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_SM),
        "memory_clock_mhz": _nvml_call(pynvml.nvmlDeviceGetMaxClockInfo, handle,
                                       pynvml.NVML_CLOCK_MEM),
        "memory_bus_width_bits": _nvml_call(bus_width, handle) if bus_width else None,
        "driver_version": _decode(_nvml_call(pynvml.nvmlSystemGetDriverVersion)),
    }


def _nvml_init() -> bool:
    if pynvml is None:
        return False
    try:
        pynvml.nvmlInit()  # reference counted by NVML, so repeated calls are fine
        return True
    except Exception:  # no driver, no library, insufficient permissions...
        return False


def _int_or_none(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None  # "[N/A]" and friends


def _smi_details(uuid: str | None, index: int) -> dict[str, object]:
    """The same details from ``nvidia-smi --query-gpu`` (no bus width there)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    target = uuid if uuid else str(index)
    cmd = [exe, f"--id={target}", "--query-gpu=clocks.max.sm,clocks.max.memory,driver_version",
           "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    parts = [p.strip() for p in out.strip().splitlines()[0].split(",")] if out.strip() else []
    if len(parts) != 3:
        return {}
    return {"sm_clock_mhz": _int_or_none(parts[0]), "memory_clock_mhz": _int_or_none(parts[1]),
            "driver_version": parts[2] or None}


def _uuid(props: object) -> str | None:
    raw = getattr(props, "uuid", None)
    if raw is None:
        return None
    text = str(raw)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def device_details(index: int) -> dict[str, object]:
    """NVML details when available, else nvidia-smi ones; keys as in GPUInfo + driver_version."""
    props = torch.cuda.get_device_properties(index)
    uuid = _uuid(props)
    details = _nvml_details(uuid, index)
    if not details or all(v is None for v in details.values()):
        details = _smi_details(uuid, index)
    return details


def _props_clock_mhz(props: object) -> int | None:
    # Some torch versions expose cudaDeviceProp.memoryClockRate (kHz) as memory_clock_rate.
    khz = getattr(props, "memory_clock_rate", None)
    return int(khz) // 1000 if khz else None


def gpu_infos() -> tuple[list[GPUInfo], str | None]:
    """All visible CUDA devices and the driver version; ([], None) without CUDA."""
    if not torch.cuda.is_available():
        return [], None
    gpus, driver = [], None
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        details = device_details(index)
        driver = driver or details.get("driver_version")
        gpus.append(GPUInfo(
            index=index,
            name=props.name,
            compute_capability=(props.major, props.minor),
            sm_count=props.multi_processor_count,
            memory_bytes=props.total_memory,
            l2_bytes=int(getattr(props, "L2_cache_size", 0) or 0),
            sm_clock_mhz=details.get("sm_clock_mhz"),
            memory_clock_mhz=details.get("memory_clock_mhz") or _props_clock_mhz(props),
            memory_bus_width_bits=details.get("memory_bus_width_bits")
            or getattr(props, "memory_bus_width", None),
        ))
    return gpus, driver
