"""Microbenchmarks on CPU (small sizes), ceilings JSON and the cache."""
from __future__ import annotations

import json
import math
from datetime import datetime, timezone

import pytest
import torch

from layer0_hardware import (
    Ceilings,
    ceilings_path,
    copy_bandwidth,
    host_device_bandwidth,
    launch_latency,
    load_ceilings,
    matmul_flops,
    measure_ceilings,
    save_ceilings,
)
from layer0_hardware import ceilings as ceilings_module


def _ok(x: float) -> bool:
    return math.isfinite(x) and x > 0


def test_copy_bandwidth_cpu():
    assert _ok(copy_bandwidth("cpu", 4 * 2**20))
    with pytest.raises(ValueError, match="nbytes"):
        copy_bandwidth("cpu", 0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_matmul_flops_cpu(dtype):
    assert _ok(matmul_flops(dtype, 128, "cpu"))


def test_matmul_flops_rejects_dtypes():
    with pytest.raises(ValueError, match="choose one of"):
        matmul_flops("fp64", 64, "cpu")
    with pytest.raises(ValueError, match="tf32"):
        matmul_flops("tf32", 64, "cpu")  # a CUDA tensor-core mode
    with pytest.raises(ValueError, match="n must be"):
        matmul_flops("fp32", 0, "cpu")


def test_launch_latency_cpu():
    seconds = launch_latency("cpu")
    assert 1e-8 < seconds < 1e-3


def test_host_device_bandwidth_needs_cuda():
    with pytest.raises(ValueError, match="direction"):
        host_device_bandwidth(True, "sideways")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            host_device_bandwidth(True)


def _sample() -> Ceilings:
    return Ceilings(device_name="Test Chip 9000", device_type="cpu", memory_bandwidth=2e10,
                    flops={"fp32": 1e11, "bf16": 4e11}, launch_latency_s=3e-6,
                    host_device_bandwidth={},
                    measured_at=datetime(2000, 1, 1, tzinfo=timezone.utc).isoformat(),
                    versions={"torch": "x"})


def test_ceilings_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_STACK_CACHE", str(tmp_path))
    c = _sample()
    path = save_ceilings(c)
    assert path == tmp_path / "ceilings" / "test-chip-9000.json" == ceilings_path("Test Chip 9000")
    assert Ceilings.from_dict(json.loads(path.read_text())) == c
    assert load_ceilings("cpu", path=path, measure_if_missing=False) == c
    assert c.peak_flops("bf16") == 4e11
    with pytest.raises(ValueError, match="available"):
        c.peak_flops("fp8")
    with pytest.raises(ValueError, match="missing keys"):
        Ceilings.from_dict({"device_name": "x"})


def test_load_ceilings_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_STACK_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="stack bench"):
        load_ceilings("cpu", measure_if_missing=False)


def test_measure_quick_and_cache(tmp_path, monkeypatch, small_cpu_matmuls):
    """One quick measurement (its matmuls small: conftest.py), made by load_ceilings because
    nothing is cached yet, checked, saved, then loaded back."""
    monkeypatch.setenv("LLM_STACK_CACHE", str(tmp_path))
    measured = []

    def measure(*args, **kwargs):
        measured.append((kwargs, measure_ceilings(*args, **kwargs)))
        return measured[-1][1]

    monkeypatch.setattr(ceilings_module, "measure_ceilings", measure)
    c = load_ceilings("cpu")
    [(kwargs, fresh)] = measured  # measured here, quick, not found cached
    assert fresh is c and kwargs["quick"] is True
    assert c.device_type == "cpu" and set(c.flops) == {"fp32", "bf16"}
    assert _ok(c.memory_bandwidth) and _ok(c.launch_latency_s)
    assert ceilings_path(c.device_name).exists()
    assert load_ceilings("cpu", measure_if_missing=False) == c
