"""Vendor datasheet numbers: what the marketing page promises, to compare measurements with.

All FLOP/s are *dense* peak rates (vendors often headline the 2:4-sparsity figure, which
is exactly twice the dense one; we never use those). Bandwidths are bytes/s in decimal
units (3.35 TB/s = 3.35e12 B/s), as datasheets print them. Memory sizes are the nominal
capacity in GiB; the driver reports a little less. The figures are data, in datasheets.json
(with the vendor document and the column each comes from).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

TB = 1e12  # decimal tera: datasheets use TB/s and TFLOPS
GiB = 2**30
FLOP_DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8", "int8")


@dataclass(frozen=True)
class AcceleratorSpec:
    """One accelerator's datasheet figures.

    peak_flops: dense FLOP/s (int8: OP/s) keyed by dtype among ``FLOP_DTYPES``.
    memory_bandwidth: DRAM bandwidth in bytes/s. memory_bytes: nominal capacity.
    interconnect: the GPU-to-GPU / host link, in words. source: the vendor document.
    """

    name: str
    peak_flops: dict[str, float] = field(hash=False)
    memory_bandwidth: float
    memory_bytes: int
    interconnect: str
    source: str

    def __post_init__(self) -> None:
        unknown = set(self.peak_flops) - set(FLOP_DTYPES)
        if unknown:
            raise ValueError(f"unknown dtype keys {sorted(unknown)}; expected {FLOP_DTYPES}")


def _load_datasheets() -> tuple[AcceleratorSpec, ...]:
    """datasheets.json: one entry per accelerator, FLOP/s as printed (dense), bandwidth in
    TB/s, memory in GiB, and a note saying which column of the vendor document they are."""
    rows = json.loads(Path(__file__).with_name("datasheets.json").read_text())
    return tuple(AcceleratorSpec(name=r["name"], peak_flops=r["peak_flops"],
                                 memory_bandwidth=r["memory_tb_s"] * TB,
                                 memory_bytes=r["memory_gib"] * GiB,
                                 interconnect=r["interconnect"], source=r["source"])
                 for r in rows)


DATASHEETS: tuple[AcceleratorSpec, ...] = _load_datasheets()

_BY_NAME = {spec.name: spec for spec in DATASHEETS}


def _has_word(text: str, word: str) -> bool:
    # Whole-token match so that "L4" does not match "L40S" and "4090" not "4090 D".
    return re.search(rf"(?<![A-Z0-9]){re.escape(word)}(?![A-Z0-9])", text) is not None


def match_datasheet(device_name: str, memory_bytes: int | None = None) -> AcceleratorSpec | None:
    """The datasheet for a device name as CUDA/ROCm reports it, or None when unknown.

    'NVIDIA H100 80GB HBM3' -> H100 SXM, 'NVIDIA H100 PCIe' -> H100 PCIe,
    'NVIDIA H200' -> H200 SXM, 'NVIDIA A100-SXM4-80GB' -> A100 SXM 80GB.
    ``memory_bytes`` (as reported by the driver) tells an A100 80GB from a 40GB one.
    Variants with different clocks or memory (H100 NVL, H200 NVL, A100 PCIe, L40S,
    RTX 4090 D) return None rather than a wrong datasheet.
    """
    if not isinstance(device_name, str):
        raise ValueError(f"device_name must be a str, got {type(device_name).__name__}")
    name = device_name.upper().replace("-", " ").replace("_", " ")
    if _has_word(name, "NVL"):
        return None
    if _has_word(name, "H100"):
        return _BY_NAME["H100 PCIe"] if _has_word(name, "PCIE") else _BY_NAME["H100 SXM"]
    if _has_word(name, "H200"):
        return _BY_NAME["H200 SXM"]
    if _has_word(name, "A100"):
        if _has_word(name, "PCIE"):
            return None
        is_80gb = _has_word(name, "80GB") or (memory_bytes is not None and memory_bytes > 60 * GiB)
        return _BY_NAME["A100 SXM 80GB"] if is_80gb else None
    if _has_word(name, "L4"):
        return _BY_NAME["L4"]
    if _has_word(name, "4090") and not re.search(r"4090\s+D\b", name):
        return _BY_NAME["RTX 4090"]
    if _has_word(name, "MI300X"):
        return _BY_NAME["MI300X"]
    return None
