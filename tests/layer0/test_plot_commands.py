"""The roofline PNG, the CLI commands and the public API surface."""
from __future__ import annotations

import json
import subprocess
import sys

import layer0_hardware
from layer0_hardware import (
    Ceilings,
    RooflinePoint,
    commands,
    match_datasheet,
    plot_roofline,
    results_dir,
)

EXPECTED_API = {
    "detect_device", "CPUInfo", "GPUInfo", "SystemInfo", "system_info", "Topology",
    "parse_nvidia_smi_topo", "read_topology", "AcceleratorSpec", "DATASHEETS",
    "match_datasheet", "Timing", "median_time", "time_fn", "copy_bandwidth",
    "host_device_bandwidth", "matmul_flops", "launch_latency", "Ceilings", "measure_ceilings",
    "ceilings_path", "save_ceilings", "load_ceilings", "arithmetic_intensity", "ridge_point",
    "attainable_flops", "classify_bound", "vector_add_cost", "matmul_cost",
    "attention_decode_cost", "RooflinePoint", "plot_roofline", "results_dir",
    "memory_bandwidth", "UsageError", "check_device", "run_command", "python_loop_ms",
    "timed_into",
}


def test_public_api_is_exactly_the_contract():
    assert set(layer0_hardware.__all__) == EXPECTED_API
    assert len(layer0_hardware.__all__) == len(EXPECTED_API)
    assert all(hasattr(layer0_hardware, name) for name in EXPECTED_API)


def test_importing_the_layers_leaves_matplotlib_until_a_plot_is_drawn():
    """Each spawned rank, engine process and CLI run imports these packages: matplotlib
    (~0.3 s) is loaded by plot_roofline's first use, not by the import."""
    probe = ("import sys, layer2_comm; assert 'matplotlib' not in sys.modules; "
             "from layer0_hardware import plot_roofline; assert 'matplotlib' in sys.modules")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_plot_roofline_writes_png(tmp_path):
    c = Ceilings("H100 test", "cuda", 3.0e12, {"bf16": 8.0e14, "fp32": 5.0e13}, 4e-6)
    points = [RooflinePoint("vector add", 1e8, 1.2e9, 5e-4),
              RooflinePoint("matmul", 1.1e12, 4e8, 1.6e-3)]
    path = plot_roofline(c, points, tmp_path / "sub" / "roof.png",
                         datasheet=match_datasheet("NVIDIA H100 80GB HBM3"), title="test")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_results_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_STACK_RESULTS", str(tmp_path))
    assert results_dir(0) == tmp_path / "layer0" and results_dir(0).is_dir()


def test_run_demo_writes_results(tmp_path, monkeypatch, capsys, small_cpu_matmuls):
    monkeypatch.setenv("LLM_STACK_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv("LLM_STACK_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    assert commands.TITLE == "hardware"
    assert commands.run(["--out", str(out)]) == 0
    c = Ceilings.from_dict(json.loads((out / "ceilings.json").read_text()))
    assert c.memory_bandwidth > 0 and c.flops
    assert (out / "roofline.png").stat().st_size > 10_000
    assert list((tmp_path / "cache" / "ceilings").glob("*.json"))
    printed = capsys.readouterr().out
    assert "measured ceilings" in printed and "roofline.png" in printed


def test_bench_quick_and_info(tmp_path, monkeypatch, capsys, small_cpu_matmuls):
    monkeypatch.setenv("LLM_STACK_CACHE", str(tmp_path / "cache"))
    assert commands.bench(["--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["device_type"] == "cpu" and report["versions"]["torch"]
    ops = [row["op"] for row in report["rows"]]
    assert any(op.startswith("copy") for op in ops) and any("matmul bf16" in op for op in ops)
    assert all(row["value"] > 0 for row in report["rows"])
    assert (tmp_path / "roofline.png").exists()
    assert commands.info([]) == 0
    assert "CPU" in capsys.readouterr().out
