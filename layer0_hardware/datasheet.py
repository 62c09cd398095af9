"""Vendor datasheet numbers: what the marketing page promises, to compare measurements with.

All FLOP/s are *dense* peak rates (vendors often headline the 2:4-sparsity figure, which
is exactly twice the dense one; we never use those). Bandwidths are bytes/s in decimal
units (3.35 TB/s = 3.35e12 B/s), as datasheets print them. Memory sizes are the nominal
capacity in GiB; the driver reports a little less.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

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


DATASHEETS: tuple[AcceleratorSpec, ...] = (
    # Source: NVIDIA H100 Tensor Core GPU datasheet (SXM5 column); dense = half of sparse.
    AcceleratorSpec(
        name="H100 SXM",
        peak_flops={"fp32": 67e12, "tf32": 494.7e12, "fp16": 989.4e12, "bf16": 989.4e12,
                    "fp8": 1978.9e12, "int8": 1978.9e12},
        memory_bandwidth=3.35 * TB, memory_bytes=80 * GiB,
        interconnect="NVLink 4: 900 GB/s; PCIe Gen5 x16: 128 GB/s (both directions)",
        source="NVIDIA H100 Tensor Core GPU datasheet (H100 SXM)",
    ),
    # Source: NVIDIA H100 Tensor Core GPU datasheet (PCIe column).
    AcceleratorSpec(
        name="H100 PCIe",
        peak_flops={"fp32": 51e12, "tf32": 378e12, "fp16": 756e12, "bf16": 756e12,
                    "fp8": 1513e12, "int8": 1513e12},
        memory_bandwidth=2.0 * TB, memory_bytes=80 * GiB,
        interconnect="NVLink bridge: 600 GB/s; PCIe Gen5 x16: 128 GB/s (both directions)",
        source="NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe)",
    ),
    # Source: NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column).
    AcceleratorSpec(
        name="H200 SXM",
        peak_flops={"fp32": 67e12, "tf32": 494.7e12, "fp16": 989.4e12, "bf16": 989.4e12,
                    "fp8": 1978.9e12, "int8": 1978.9e12},
        memory_bandwidth=4.8 * TB, memory_bytes=141 * GiB,
        interconnect="NVLink 4: 900 GB/s; PCIe Gen5 x16: 128 GB/s (both directions)",
        source="NVIDIA H200 Tensor Core GPU datasheet (H200 SXM)",
    ),
    # Source: NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column). No FP8 units.
    AcceleratorSpec(
        name="A100 SXM 80GB",
        peak_flops={"fp32": 19.5e12, "tf32": 156e12, "fp16": 312e12, "bf16": 312e12,
                    "int8": 624e12},
        memory_bandwidth=2.039 * TB, memory_bytes=80 * GiB,
        interconnect="NVLink 3: 600 GB/s; PCIe Gen4 x16: 64 GB/s (both directions)",
        source="NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM)",
    ),
    # Source: NVIDIA L4 Tensor Core GPU datasheet; dense = half of the sparse figures.
    AcceleratorSpec(
        name="L4",
        peak_flops={"fp32": 30.3e12, "tf32": 60e12, "fp16": 121e12, "bf16": 121e12,
                    "fp8": 242.5e12, "int8": 242.5e12},
        memory_bandwidth=0.3 * TB, memory_bytes=24 * GiB,
        interconnect="PCIe Gen4 x16: 64 GB/s (both directions); no NVLink",
        source="NVIDIA L4 Tensor Core GPU datasheet",
    ),
    # Source: NVIDIA Ada Lovelace GPU Architecture whitepaper (GeForce RTX 4090 table).
    # Tensor figures are the FP32-accumulate ones, which is what torch's matmuls use;
    # GeForce parts run FP16-accumulate twice as fast.
    AcceleratorSpec(
        name="RTX 4090",
        peak_flops={"fp32": 82.6e12, "tf32": 82.6e12, "fp16": 165.2e12, "bf16": 165.2e12,
                    "fp8": 330.3e12, "int8": 660.6e12},
        memory_bandwidth=1.008 * TB, memory_bytes=24 * GiB,
        interconnect="PCIe Gen4 x16: 64 GB/s (both directions); no NVLink",
        source="NVIDIA Ada Lovelace GPU Architecture whitepaper (GeForce RTX 4090)",
    ),
    # Source: AMD Instinct MI300X accelerator datasheet; fp32 is the matrix-core figure.
    AcceleratorSpec(
        name="MI300X",
        peak_flops={"fp32": 163.4e12, "tf32": 653.7e12, "fp16": 1307.4e12, "bf16": 1307.4e12,
                    "fp8": 2614.9e12, "int8": 2614.9e12},
        memory_bandwidth=5.3 * TB, memory_bytes=192 * GiB,
        interconnect="AMD Infinity Fabric: 7 links x 128 GB/s to peers; PCIe Gen5 x16",
        source="AMD Instinct MI300X accelerator datasheet",
    ),
)

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
