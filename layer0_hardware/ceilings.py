"""Ceilings: this machine's measured roofline, cached as JSON for every later layer.

Layer 1 and up report "fraction of the ceiling" for their kernels; they read these numbers
with ``load_ceilings()`` instead of trusting a datasheet, because a real chip under a real
driver reaches ~80-95 % of its datasheet bandwidth and FLOP/s, never 100 %.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .introspect import device_name, software_versions
from .microbench import host_device_bandwidth, launch_latency, matmul_flops, memory_bandwidth
from .progress import steps_progress
from .timing import resolve_device

MiB = 2**20


@dataclass
class Ceilings:
    """Measured ceilings of one device.

    memory_bandwidth: bytes/s read + written, the faster of a copy and an add stream.
    flops: dtype -> FLOP/s of a large matmul. Both are the fastest of repeated runs, so that
    they bound what the ops measured against them reach (microbench.py says why).
    launch_latency_s: seconds per tiny kernel. host_device_bandwidth: e.g.
    "h2d_pinned" -> bytes/s (empty on CPU). measured_at: ISO 8601 date-time.
    versions: software versions at measurement time.
    """

    device_name: str
    device_type: str
    memory_bandwidth: float
    flops: dict[str, float]
    launch_latency_s: float
    host_device_bandwidth: dict[str, float] = field(default_factory=dict)
    measured_at: str = ""
    versions: dict[str, str] = field(default_factory=dict)

    def peak_flops(self, dtype: str) -> float:
        """Measured matmul FLOP/s for ``dtype``; ValueError naming what was measured."""
        if dtype not in self.flops:
            raise ValueError(f"no measured FLOP/s for dtype {dtype!r} on {self.device_name}; "
                             f"available: {sorted(self.flops)}")
        return self.flops[dtype]

    def to_dict(self) -> dict:
        """Plain JSON-able dict (the format of ceilings.json)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Ceilings:
        """Inverse of ``to_dict``; ValueError naming missing keys."""
        required = ("device_name", "device_type", "memory_bandwidth", "flops", "launch_latency_s")
        missing = [key for key in required if key not in d]
        if missing:
            raise ValueError(f"ceilings data is missing keys {missing}")
        return cls(
            device_name=str(d["device_name"]),
            device_type=str(d["device_type"]),
            memory_bandwidth=float(d["memory_bandwidth"]),
            flops={str(k): float(v) for k, v in d["flops"].items()},
            launch_latency_s=float(d["launch_latency_s"]),
            host_device_bandwidth={str(k): float(v)
                                   for k, v in d.get("host_device_bandwidth", {}).items()},
            measured_at=str(d.get("measured_at", "")),
            versions={str(k): str(v) for k, v in d.get("versions", {}).items()},
        )


def now_iso() -> str:
    """Current local date-time, ISO 8601 with offset, to the second."""
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def _plan(dev: torch.device, quick: bool) -> tuple[int, int, tuple[str, ...], tuple[str, ...]]:
    """(copy bytes, matmul n, matmul dtypes, host transfer kinds) for a measurement."""
    if dev.type == "cuda":
        dtypes = ("fp32", "tf32", "fp16", "bf16", "fp8")
        if quick:
            return 256 * MiB, 8192, dtypes, ("h2d_pinned", "d2h_pinned")
        return 1024 * MiB, 8192, dtypes, ("h2d_pinned", "d2h_pinned", "h2d_pageable",
                                          "d2h_pageable")
    # A CPU's BLAS reaches its plateau from n ~ 1024 (a 512 matmul measured 10x below it).
    return (64 * MiB if quick else 256 * MiB), (1024 if quick else 2048), ("fp32", "bf16"), ()


def measure_ceilings(device: torch.device | str | None = None, *, quick: bool = False,
                     progress: bool = True) -> Ceilings:
    """Measure copy bandwidth, matmul FLOP/s per dtype, launch latency and (on CUDA)
    host<->device bandwidth. quick: smaller sizes for demos (seconds on a CPU).

    On CUDA fp8 is measured only where supported (compute capability >= 8.9).
    """
    dev = resolve_device(device)
    copy_bytes, n, dtypes, transfers = _plan(dev, quick)
    steps = ["memory bandwidth", *(f"matmul {d}" for d in dtypes), "launch latency",
             *(f"host {t}" for t in transfers)]
    flops: dict[str, float] = {}
    host: dict[str, float] = {}
    bandwidth = latency = 0.0
    with steps_progress(steps, enabled=progress, title="measuring ceilings") as advance:
        bandwidth = memory_bandwidth(dev, copy_bytes)
        advance()
        for dtype in dtypes:
            try:
                flops[dtype] = matmul_flops(dtype, n, dev, peak=True)
            except NotImplementedError:
                pass  # e.g. fp8 on a GPU without FP8 tensor cores: simply not a ceiling here
            advance()
        latency = launch_latency(dev)
        advance()
        for kind in transfers:
            direction, memory = kind.split("_")
            host[kind] = host_device_bandwidth(memory == "pinned", direction,
                                               (64 if quick else 256) * MiB)
            advance()
    return Ceilings(device_name=device_name(dev), device_type=dev.type,
                    memory_bandwidth=bandwidth, flops=flops, launch_latency_s=latency,
                    host_device_bandwidth=host, measured_at=now_iso(),
                    versions=software_versions())


def _slug(name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown-device"


def ceilings_path(device_name: str) -> Path:
    """``$LLM_STACK_CACHE/ceilings/<slug>.json``, default ``~/.cache/llm-stack/ceilings/...``.

    The slug is the device name lower-cased with runs of other characters turned into '-'
    ('NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3').
    """
    if not isinstance(device_name, str) or not device_name.strip():
        raise ValueError(f"device_name must be a non-empty str, got {device_name!r}")
    root = os.environ.get("LLM_STACK_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "llm-stack"
    return base / "ceilings" / f"{_slug(device_name)}.json"


def save_ceilings(c: Ceilings, path: str | Path | None = None) -> Path:
    """Write ``c`` as JSON (default: ``ceilings_path(c.device_name)``); returns the path."""
    target = Path(path) if path is not None else ceilings_path(c.device_name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(c.to_dict(), indent=2) + "\n")
    tmp.replace(target)  # atomic: a concurrent reader never sees half a file
    return target


def load_ceilings(device: torch.device | str | None = None, *, path: str | Path | None = None,
                  measure_if_missing: bool = True) -> Ceilings:
    """The cached ceilings of ``device`` (default: the detected one).

    When nothing is cached, measure quickly and save if ``measure_if_missing``; otherwise
    raise FileNotFoundError saying how to create the cache.
    """
    dev = resolve_device(device)
    target = Path(path) if path is not None else ceilings_path(device_name(dev))
    if target.exists():
        try:
            return Ceilings.from_dict(json.loads(target.read_text()))
        except (json.JSONDecodeError, ValueError, AttributeError) as err:
            raise ValueError(f"corrupt ceilings file {target}: {err}; delete it to "
                             "re-measure") from err
    if not measure_if_missing:
        raise FileNotFoundError(
            f"no ceilings cached for {device_name(dev)!r} at {target}; run "
            "`stack bench --layer 0` (or `python -m layer0_hardware`) to measure them")
    ceilings = measure_ceilings(dev, quick=True, progress=True)
    save_ceilings(ceilings, target)
    return ceilings
