"""What CPU is this? Model, cores, caches and RAM, from Linux files with portable fallbacks.

Sources, best first: psutil (cores, RAM), /proc/cpuinfo (model), sysfs
/sys/devices/system/cpu/cpu0/cache (cache sizes), ``lscpu`` (model and caches on ARM
boards such as Grace, whose /proc/cpuinfo has no model name), then the stdlib.
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

try:  # psutil is a declared dependency, but introspection must not die without it
    import psutil
except ImportError:  # pragma: no cover - exercised only on minimal installs
    psutil = None

_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


@dataclass
class CPUInfo:
    """Host CPU summary. caches: level name ("L1d", "L1i", "L2", "L3") -> size text
    ("48K"); memory_bytes: total RAM in bytes."""

    model: str
    physical_cores: int
    logical_cores: int
    caches: dict[str, str] = field(default_factory=dict)
    memory_bytes: int = 0


def _lscpu() -> dict[str, str]:
    exe = shutil.which("lscpu")
    if exe is None:
        return {}
    try:
        out = subprocess.run([exe], capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = {}
    for line in out.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def _model_name(lscpu: dict[str, str]) -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    if match:
        return match.group(1).strip()
    if lscpu.get("Model name") and lscpu["Model name"] != "-":
        return lscpu["Model name"]
    return platform.processor() or platform.machine() or "unknown CPU"


def _caches_from_sysfs() -> dict[str, str]:
    caches: dict[str, str] = {}
    for index in sorted(_CACHE_DIR.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
        caches[f"L{level}{suffix}"] = size
    return caches


def _caches_from_lscpu(lscpu: dict[str, str]) -> dict[str, str]:
    # lscpu prints e.g. "L2 cache: 4 MiB (2 instances)": keep the size, drop the count.
    caches = {}
    for key, value in lscpu.items():
        match = re.fullmatch(r"(L\d[di]?) cache", key)
        if match:
            caches[match.group(1)] = value.split(" (")[0]
    return caches


def _physical_cores() -> int:
    if psutil is not None:
        count = psutil.cpu_count(logical=False)
        if count:
            return int(count)
    try:  # count distinct (socket, core) pairs
        text = Path("/proc/cpuinfo").read_text()
        pairs = set(re.findall(r"physical id\s*:\s*(\d+)[\s\S]*?core id\s*:\s*(\d+)", text))
        if pairs:
            return len(pairs)
    except OSError:
        pass
    return os.cpu_count() or 1


def _memory_bytes() -> int:
    if psutil is not None:
        return int(psutil.virtual_memory().total)
    try:
        match = re.search(r"MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text())
        if match:
            return int(match.group(1)) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def cpu_info() -> CPUInfo:
    """Describe the host CPU; every field has a fallback, so this never raises."""
    lscpu = _lscpu()
    logical = (
        (psutil.cpu_count(logical=True) if psutil is not None else None) or os.cpu_count() or 1
    )
    return CPUInfo(
        model=_model_name(lscpu),
        physical_cores=_physical_cores(),
        logical_cores=int(logical),
        caches=_caches_from_sysfs() or _caches_from_lscpu(lscpu),
        memory_bytes=_memory_bytes(),
    )
