"""GPU-only checks (skipped without CUDA by tests/conftest.py): sanity, not perf targets."""
from __future__ import annotations

import json

import pytest
import torch

from layer0_hardware import (
    commands,
    copy_bandwidth,
    host_device_bandwidth,
    launch_latency,
    match_datasheet,
    matmul_flops,
    system_info,
    time_fn,
)

pytestmark = pytest.mark.gpu


def _spec():
    props = torch.cuda.get_device_properties(0)
    return match_datasheet(props.name, props.total_memory)


def test_system_info_reports_the_gpu():
    info = system_info()
    assert info.gpus, "CUDA is available but no GPU was reported"
    gpu = info.gpus[0]
    assert gpu.sm_count > 0 and gpu.memory_bytes > 0 and gpu.l2_bytes > 0
    assert gpu.compute_capability >= (3, 0) and info.cuda_version


def test_time_fn_uses_events():
    a = torch.randn(2048, 2048, device="cuda")
    timing = time_fn(lambda: a @ a, repeats=5, device="cuda")
    assert 0 < timing.median_s < 1.0 and len(timing.samples) == 5


def test_copy_bandwidth_below_datasheet():
    measured = copy_bandwidth("cuda", 512 * 2**20)
    assert measured > 0
    spec = _spec()
    if spec is not None:
        assert measured < 1.3 * spec.memory_bandwidth


@pytest.mark.parametrize("dtype", ["fp32", "tf32", "bf16", "fp16", "fp8"])
def test_matmul_flops_below_datasheet(dtype):
    try:
        measured = matmul_flops(dtype, 4096, "cuda")
    except NotImplementedError as err:
        pytest.skip(str(err))
    assert measured > 0
    spec = _spec()
    if spec is not None and dtype in spec.peak_flops:
        assert measured < 1.3 * spec.peak_flops[dtype]


def test_tf32_setting_is_restored():
    before = torch.backends.cuda.matmul.fp32_precision if hasattr(
        torch.backends.cuda.matmul, "fp32_precision") else torch.backends.cuda.matmul.allow_tf32
    matmul_flops("tf32", 1024, "cuda")
    after = torch.backends.cuda.matmul.fp32_precision if hasattr(
        torch.backends.cuda.matmul, "fp32_precision") else torch.backends.cuda.matmul.allow_tf32
    assert before == after


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_host_device_bandwidth_pinned(direction):
    pinned = host_device_bandwidth(True, direction, 64 * 2**20)
    assert 1e8 < pinned < 1e12  # 0.1 GB/s .. 1 TB/s covers PCIe Gen3 to NVLink-C2C


def test_launch_latency_range():
    assert 1e-6 < launch_latency("cuda") < 1e-3


def test_bench_quick(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_STACK_CACHE", str(tmp_path / "cache"))
    assert commands.bench(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["device_type"] == "cuda"
    assert any(row["op"].startswith("h2d pinned") for row in report["rows"])
