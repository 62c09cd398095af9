"""Datasheet table sanity and name matching."""
from __future__ import annotations

import pytest

from layer0_hardware import DATASHEETS, AcceleratorSpec, match_datasheet


@pytest.mark.parametrize(("device_name", "expected"), [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ("AMD Instinct MI300X", "MI300X"),
])
def test_known_devices(device_name, expected):
    spec = match_datasheet(device_name)
    assert spec is not None and spec.name == expected


@pytest.mark.parametrize("device_name", ["Tesla T4", "NVIDIA L40S", "NVIDIA H100 NVL",
                                         "Intel(R) Xeon(R) Processor", ""])
def test_unknown_devices(device_name):
    assert match_datasheet(device_name) is None


def test_memory_tells_a100_variants_apart():
    assert match_datasheet("NVIDIA A100-SXM4", 85 * 10**9).name == "A100 SXM 80GB"
    assert match_datasheet("NVIDIA A100-SXM4", 42 * 10**9) is None


def test_table_is_dense_and_consistent():
    names = [spec.name for spec in DATASHEETS]
    assert len(names) == len(set(names)) == 7
    for spec in DATASHEETS:
        assert isinstance(spec, AcceleratorSpec) and spec.source
        assert spec.memory_bandwidth > 1e11 and spec.memory_bytes > 2**30
        # Dense tensor rates: bf16 is twice tf32 on every one of these parts.
        assert spec.peak_flops["bf16"] == pytest.approx(2 * spec.peak_flops["tf32"], rel=0.03)
    h100 = match_datasheet("NVIDIA H100 80GB HBM3")
    assert h100.peak_flops["bf16"] == pytest.approx(989.4e12)  # not the 1979 sparse figure
    assert h100.memory_bandwidth == pytest.approx(3.35e12)


def test_bad_keys_rejected():
    with pytest.raises(ValueError, match="unknown dtype"):
        AcceleratorSpec("x", {"fp64": 1.0}, 1.0, 1, "", "")
