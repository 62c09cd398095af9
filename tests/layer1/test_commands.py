"""`stack run --layer 1` checks every kernel here; `stack bench --layer 1` needs a GPU."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from layer1_kernels import checks, commands, hardware


@pytest.fixture(scope="module")
def check_results() -> list:
    """Every kernel's check, run once for the module (about 10 s in the interpreter)."""
    return checks.run_checks()


def test_every_kernel_check_passes_on_this_machine(check_results):
    results = check_results
    assert len([r for r in results if r.rel_error is not None]) >= 10
    failed = {r.name: (r.rel_error, r.note) for r in results if r.ok is False}
    assert not failed


def test_a_wrong_kernel_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(checks, "_checks", lambda: [
        ("broken", "3", lambda: (torch.zeros(3), torch.ones(3))),
        ("raises", "3", lambda: (_ for _ in ()).throw(ValueError("bad shape"))),
    ])
    results = {r.name: r for r in checks.run_checks()}
    assert results["broken"].ok is False and results["broken"].rel_error == pytest.approx(1.0)
    assert results["raises"].ok is False and "bad shape" in results["raises"].note


def test_run_prints_the_checks_and_exits_zero_only_if_all_passed(capsys, monkeypatch,
                                                                 check_results):
    monkeypatch.setattr(checks, "run_checks", lambda: check_results)  # the same checks, once
    assert commands.run([]) == 0
    assert "flash_attention" in capsys.readouterr().out
    broken = [dataclasses.replace(check_results[0], rel_error=1.0), *check_results[1:]]
    monkeypatch.setattr(checks, "run_checks", lambda: broken)
    assert commands.run([]) == 1
    assert f"failed: {broken[0].name}" in capsys.readouterr().out


def test_bench_without_a_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    # A user's mistake, not a bug: one line and exit code 2 through the CLI's wrapper.
    assert hardware.run_command(commands.bench, []) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "need a CUDA GPU" in err and "\n" not in err


@pytest.mark.gpu
def test_bench_writes_results(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_STACK_RESULTS", str(tmp_path))
    assert commands.bench(["--groups", "elementwise", "--no-demos"]) == 0
    body = json.loads((tmp_path / "layer1" / "bench.json").read_text())
    assert body["results"] and all(r["ours_s"] > 0 for r in body["results"])
    assert (tmp_path / "layer1" / "roofline.png").stat().st_size > 0
