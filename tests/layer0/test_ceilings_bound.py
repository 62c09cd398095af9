"""Ceilings bound what is measured against them: they are the fastest of repeated runs
(noise only slows a run down), and a point above its roof is flagged, never shown as fine."""
from __future__ import annotations

from rich.console import Console

from layer0_hardware import Ceilings, RooflinePoint, Timing
from layer0_hardware import microbench as mb
from layer0_hardware.report import points_table


def _fake_time_fn(samples: list[float]):
    calls = []

    def time_fn(fn, *, warmup=3, repeats=20, device=None):
        calls.append(repeats)
        return Timing.from_samples(samples[:repeats])

    return time_fn, calls


def test_ceilings_take_the_fastest_repeat_and_ops_the_median(monkeypatch):
    samples = [0.4, 0.1, 0.5, 0.2, 0.3, 0.9, 0.6, 0.7, 0.8]  # a busy machine: one good run
    fake, calls = _fake_time_fn(samples)
    monkeypatch.setattr(mb, "time_fn", fake)
    n = 64
    assert mb.matmul_flops("fp32", n, "cpu", peak=True) == 2 * n**3 / 0.1
    assert calls[-1] == 9  # more repeats for a ceiling: more chances of an undisturbed run
    typical = mb.matmul_flops("fp32", n, "cpu")
    assert typical == 2 * n**3 / Timing.from_samples(samples[:calls[-1]]).median_s


def test_memory_ceiling_is_the_faster_stream(monkeypatch):
    fake, _ = _fake_time_fn([0.01] * 9)  # add and copy take the same time: add moves 3/2 more
    monkeypatch.setattr(mb, "time_fn", fake)
    nbytes = 4 * 2**20
    assert mb.memory_bandwidth("cpu", nbytes) == 3 * nbytes / 0.01


def _render(table) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_a_point_above_its_roof_is_flagged():
    ceilings = Ceilings("test cpu", "cpu", memory_bandwidth=10e9, flops={"fp32": 100e9},
                        launch_latency_s=1e-6)
    fine = RooflinePoint("under the roof", flops=1e9, nbytes=1e9, seconds=0.2)  # 50 %
    above = RooflinePoint("over the roof", flops=2e9, nbytes=1e6, seconds=0.01)  # 200 %
    text = _render(points_table([fine, above], ceilings, "fp32"))
    assert "50.0%" in text and "200.0%!" in text
    assert "above the measured roof: over the roof" in text
    assert "above the measured roof" not in _render(points_table([fine], ceilings, "fp32"))
