"""`stack run --layer 1` checks every kernel here; `stack bench --layer 1` needs a GPU."""
from __future__ import annotations

import json

import pytest
import torch

from layer1_kernels import checks, commands, hardware


def test_every_kernel_check_passes_on_this_machine():
    results = checks.run_checks()
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


def test_run_exits_zero(capsys):
    assert commands.run([]) == 0
    assert "flash_attention" in capsys.readouterr().out


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
