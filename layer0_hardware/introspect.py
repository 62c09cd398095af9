"""What machine is this? The device to use, and a summary of CPU, GPUs and software.

``detect_device`` is what every layer calls to pick where tensors live;
``system_info`` gathers everything the demo prints and the benchmarks record.
"""
from __future__ import annotations

import importlib.metadata
import platform
from dataclasses import dataclass, field

import torch

from .cpu_info import CPUInfo, cpu_info
from .gpu_info import GPUInfo, gpu_infos
from .topology import Topology, read_topology

__all__ = ["CPUInfo", "GPUInfo", "SystemInfo", "detect_device", "system_info",
           "device_name", "software_versions"]


def detect_device() -> torch.device:
    """``cuda:0`` when a CUDA GPU is visible, else ``cpu``."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


@dataclass
class SystemInfo:
    """CPU, GPUs (empty list without CUDA), library versions (None when absent) and
    the GPU interconnect topology (None without nvidia-smi)."""

    cpu: CPUInfo
    gpus: list[GPUInfo] = field(default_factory=list)
    torch_version: str = torch.__version__
    cuda_version: str | None = None
    driver_version: str | None = None
    nccl_version: str | None = None
    triton_version: str | None = None
    topology: Topology | None = None


def _nccl_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # CPU builds lack the binding; ROCm builds may raise
        return None
    if isinstance(version, tuple):  # (2, 21, 5) in recent torch
        return ".".join(str(part) for part in version)
    # Older torch returned one int: major*10000 + minor*100 + patch (or *1000 before 2.9).
    major, rest = divmod(int(version), 10000 if version >= 10000 else 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def _triton_version() -> str | None:
    # Read the installed metadata instead of importing triton (slow, and it may probe GPUs).
    for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def system_info() -> SystemInfo:
    """Describe this machine. Works without a GPU, NVML or nvidia-smi."""
    gpus, driver = gpu_infos()
    return SystemInfo(
        cpu=cpu_info(),
        gpus=gpus,
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        driver_version=driver,
        nccl_version=_nccl_version(),
        triton_version=_triton_version(),
        topology=read_topology(),
    )


def device_name(device: torch.device | str | None = None) -> str:
    """Human name of a device: the GPU's marketing name, or the CPU model for ``cpu``."""
    dev = torch.device(device) if device is not None else detect_device()
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {dev} requested but CUDA is not available on this machine")
        return torch.cuda.get_device_name(dev.index or 0)
    if dev.type == "cpu":
        return cpu_info().model
    raise ValueError(f"unsupported device type {dev.type!r}; expected 'cuda' or 'cpu'")


def software_versions(info: SystemInfo | None = None) -> dict[str, str]:
    """Versions worth recording next to any measurement (absent ones left out)."""
    info = info if info is not None else system_info()
    versions = {"python": platform.python_version(), "torch": info.torch_version,
                "cuda": info.cuda_version, "driver": info.driver_version,
                "nccl": info.nccl_version, "triton": info.triton_version}
    return {key: value for key, value in versions.items() if value}
