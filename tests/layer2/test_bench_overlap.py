"""The sweep, the overlap demo, the CLI commands and the raw NCCL example.

CPU tests spawn 2 gloo ranks with tiny sizes; GPU tests check fields and results only,
never performance (CI does not time anything).
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from layer2_comm import commands
from layer2_comm.bench_bandwidth import default_sizes, ping_pong, sweep
from layer2_comm.launch import launch
from layer2_comm.nccl_raw import nccl_example
from layer2_comm.overlap import efficiency, overlap_demo

OVERLAP_FIELDS = {"t_comm_s", "t_comp_s", "t_both_s", "efficiency", "matmuls", "comm_bytes",
                  "backend", "world", "correct", "efficiency_per_rank"}


def _tiny_sweep() -> dict:
    """Every rank: a few sizes of each collective, ours and built-in, and a ping-pong."""
    sizes = [8, 100, 4096]
    rows = []
    for collective in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all",
                       "tree_all_reduce", "broadcast_chain"):
        rows += sweep(collective, sizes, ours=True, iters=2, warmup=1)
    rows += sweep("all_reduce", sizes, ours=False, iters=2, warmup=1)
    rows += sweep("reduce_scatter", sizes, ours=False, iters=2, warmup=1)
    rows += sweep("all_to_all", sizes, ours=False, iters=2, warmup=1)
    return {"rows": rows, "ping": ping_pong(sizes, iters=2, warmup=1)}


@pytest.mark.usefixtures("fork_server")
def test_tiny_sweep_on_two_gloo_ranks_returns_sane_rows():
    results = launch(_tiny_sweep, 2, backend="gloo", timeout_s=90)
    assert results[0] == results[1]  # times are the slowest rank's, so every rank agrees
    rows = results[0]["rows"]
    assert len(rows) == 10 * 3
    for r in rows:
        assert r["ok"], r
        assert r["world"] == 2 and r["backend"] == "gloo" and r["time_s"] > 0
        assert r["algbw"] == pytest.approx(r["bytes"] / r["time_s"])
    by = {(r["algorithm"], r["bytes"]): r for r in rows}
    all_reduce = by["ring_all_reduce", 4096]
    assert all_reduce["busbw"] == pytest.approx(all_reduce["algbw"] * 1.0)  # 2(n-1)/n at n=2
    gather = by["ring_all_gather", 4096]
    assert gather["busbw"] == pytest.approx(gather["algbw"] * 0.5)
    assert by["ring_all_gather", 8]["count"] == 2  # 8 bytes = one fp32 per rank, two gathered
    assert "torch.all_reduce" in {r["algorithm"] for r in rows}
    assert [p["bytes"] for p in results[0]["ping"]] == [8, 100, 4096]
    assert all(p["time_s"] > 0 for p in results[0]["ping"])


def test_sweep_outside_a_group_and_bad_names_are_clear_errors():
    with pytest.raises(RuntimeError, match="inside a process group"):
        sweep("all_reduce", [8], ours=True)
    with pytest.raises(ValueError, match="factor"):
        default_sizes(1024, 8, 1)
    assert default_sizes(64, 8, 2) == [8, 16, 32, 64]


@pytest.mark.usefixtures("fork_server")
def test_overlap_demo_on_cpu_returns_the_fields():
    out = overlap_demo(2, comm_bytes=1 << 18, matmul_n=64, iters=2, warmup=1, backend="gloo")
    assert OVERLAP_FIELDS <= set(out)
    assert out["backend"] == "gloo" and out["world"] == 2 and out["correct"] is True
    assert min(out["t_comm_s"], out["t_comp_s"], out["t_both_s"]) > 0 and out["matmuls"] >= 1
    assert math.isfinite(out["efficiency"]) and len(out["efficiency_per_rank"]) == 2
    assert out["efficiency"] == pytest.approx(efficiency(out["t_comp_s"], out["t_comm_s"], out["t_both_s"]))


def test_efficiency_formula():
    assert efficiency(1.0, 1.0, 1.0) == pytest.approx(1.0)   # one hid the other entirely
    assert efficiency(1.0, 1.0, 2.0) == pytest.approx(0.0)   # serialised
    assert efficiency(3.0, 1.0, 3.5) == pytest.approx(0.5)   # half the comm hidden


@pytest.mark.usefixtures("fork_server")
def test_run_command_checks_every_collective_on_two_ranks(capsys):
    assert commands.run(["--world", "2", "--iters", "2", "--backend", "gloo"]) == 0
    out = capsys.readouterr().out
    for name in ("ring_all_reduce", "tree_all_reduce", "ring_reduce_scatter", "all_to_all",
                 "hierarchical_all_reduce", "broadcast_chain"):
        assert name in out
    assert "NO" not in out


@pytest.mark.usefixtures("fork_server")
def test_bench_command_writes_json_markdown_and_plots(tmp_path, capsys):
    argv = ["--world", "2", "--backend", "gloo", "--max-bytes", "4096", "--factor", "8",
            "--iters", "2", "--out", str(tmp_path)]
    assert commands.bench(argv) == 0
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["world"] == 2 and record["alpha_s"] >= 0 and record["beta_s_per_byte"] >= 0
    algorithms = {r["algorithm"] for r in record["rows"]}
    assert {"ring_all_reduce", "torch.all_reduce", "ring_all_gather", "ring_reduce_scatter",
            "tree_all_reduce"} <= algorithms
    assert record["crossover_predicted_bytes"] is None  # on 2 ranks tree never loses in the model
    assert record["overlap"]["correct"] and record["overlap"]["backend"] == "gloo"  # measured, not judged
    assert "| collective | size |" in (tmp_path / "bench.md").read_text()
    for png in ("time_vs_size.png", "busbw.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    assert "crossover" in capsys.readouterr().out


def test_nccl_example_without_cuda_says_so():
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs; the multigpu test runs the example")
    with pytest.raises(RuntimeError, match="CUDA|CuPy|GPU"):
        nccl_example()


@pytest.mark.multigpu
def test_nccl_example_all_reduces_exactly():
    out = nccl_example(count=1 << 20, iters=5)
    assert out["ok"] and out["max_error"] == 0.0
    assert out["world"] == torch.cuda.device_count() and out["algbw"] > 0
    assert out["busbw"] == pytest.approx(out["algbw"] * 2 * (out["world"] - 1) / out["world"])


@pytest.mark.gpu
def test_nccl_example_asks_for_two_gpus_per_rank():
    with pytest.raises(RuntimeError, match="2 or more GPUs"):
        nccl_example(torch.cuda.device_count() + 1)


@pytest.mark.multigpu
def test_overlap_on_gpus_returns_fields_and_correct_results():
    out = overlap_demo(2, comm_bytes=16 << 20, matmul_n=1024, iters=3, warmup=1, timeout_s=120)
    assert OVERLAP_FIELDS | {"side_stream_efficiency", "t_both_side_stream_s", "lean_efficiency",
                             "lean_t_comm_s", "sms"} <= set(out)
    assert out["backend"] == "nccl" and out["correct"] is True and out["device"].startswith("cuda")
    assert all(math.isfinite(e) for e in out["efficiency_per_rank"])


@pytest.mark.multigpu
def test_bench_on_gpus(tmp_path):
    argv = ["--max-bytes", str(1 << 20), "--factor", "16", "--iters", "3", "--timeout", "150",
            "--out", str(tmp_path)]
    assert commands.bench(argv) == 0
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["backend"] == "nccl" and record["world"] == torch.cuda.device_count()
    assert all(r["ok"] for r in record["rows"])
    assert record["overlap"]["correct"] and "lean_efficiency" in record["overlap"]


@pytest.mark.multigpu
def test_run_on_gpus():
    assert commands.run(["--iters", "2", "--timeout", "120"]) == 0
