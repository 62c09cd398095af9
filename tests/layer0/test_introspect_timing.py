"""Introspection on this machine and the timers' behaviour."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from layer0_hardware import (
    CPUInfo,
    SystemInfo,
    Timing,
    detect_device,
    median_time,
    system_info,
    time_fn,
    timing,
)


def test_system_info_describes_this_machine():
    info = system_info()
    assert isinstance(info, SystemInfo) and isinstance(info.cpu, CPUInfo)
    assert info.cpu.logical_cores >= info.cpu.physical_cores > 0
    assert info.cpu.memory_bytes > 0 and info.cpu.model
    assert info.torch_version == torch.__version__
    if not torch.cuda.is_available():
        assert info.gpus == [] and info.cuda_version is None
        assert detect_device() == torch.device("cpu")


def test_median_time_counts_warmups_and_ignores_an_outlier(monkeypatch):
    # A virtual clock that only fn() advances: the answer is exact however busy the machine
    # (a real sleep(0.001) may take tens of ms there).
    now, calls = [0.0], []

    def fn():
        # Call 3 (the second timed call, after 2 warm-ups) is a 0.2 s outlier.
        now[0] += 0.2 if len(calls) == 3 else 0.001
        calls.append(1)

    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    seconds = median_time(fn, warmup=2, repeats=7)
    assert len(calls) == 9
    assert seconds == pytest.approx(0.001)


def test_median_time_rejects_bad_counts():
    with pytest.raises(ValueError, match="repeats"):
        median_time(lambda: None, repeats=0)
    with pytest.raises(ValueError, match="warmup"):
        median_time(lambda: None, warmup=-1)


def test_time_fn_on_cpu():
    calls = []
    timing = time_fn(lambda: calls.append(time.sleep(0.001)), warmup=1, repeats=5, device="cpu")
    assert isinstance(timing, Timing)
    assert len(calls) == 6 and len(timing.samples) == 5
    assert timing.min_s <= timing.median_s <= max(timing.samples)
    assert timing.median_s >= 0.0009


def test_time_fn_refuses_missing_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="CUDA is not available"):
        time_fn(lambda: None, device="cuda")


def test_timed_into_adds_each_calls_seconds_also_when_it_raises():
    from layer0_hardware import timed_into

    ticks = iter([1.0, 1.5, 4.0, 6.0])  # a fake clock: calls of 0.5 s and 2 s
    added: list[float] = []

    def work(x: int) -> int:
        """doc"""
        if x < 0:
            raise ValueError(x)
        return 2 * x

    timed = timed_into(work, added.append, clock=lambda: next(ticks))
    assert timed(3) == 6 and timed.__name__ == "work" and timed.__doc__ == "doc"
    with pytest.raises(ValueError):
        timed(-1)
    assert added == [0.5, 2.0]
