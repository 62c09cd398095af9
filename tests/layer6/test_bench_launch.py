"""The bench's server process (bench_launch.py) and `stack bench --layer 6` end to end: the
server runs apart from the client, answers, and leaves nothing behind."""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

from layer6_serving.bench.launch import ServerProcess, free_port
from layer6_serving.bench.peer import peer_available
from layer6_serving.bench.serving import bench

# A tiny health server that also starts a grandchild: stop() must end both.
SERVER = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[2], "w").write(str(child.pid))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
print("up", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _gone(pid: int, wait: float = 15.0) -> bool:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie of ours counts as gone once reaped
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return False


def test_server_process_waits_for_health_and_stops_its_whole_group(tmp_path):
    port, pidfile = free_port(), tmp_path / "child.pid"
    with ServerProcess([sys.executable, "-c", SERVER, str(port), str(pidfile)],
                       f"http://127.0.0.1:{port}", start_timeout=60) as srv:
        assert srv.alive
        grandchild = int(pidfile.read_text())
        assert "up" in srv.log_tail()
    assert not srv.alive and _gone(srv.proc.pid) and _gone(grandchild)


# Deaf to SIGINT, as `transformers serve` is after continuous batching (its process outlives
# uvicorn's shutdown): only the stop signal the bench gives the peer ends it without the grace.
DEAF = """
import http.server, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_the_peer_is_stopped_with_its_own_signal_not_after_the_grace():
    from layer6_serving.bench.peer import PEER_STOP_SIGNAL

    port = free_port()
    srv = ServerProcess([sys.executable, "-c", DEAF, str(port)], f"http://127.0.0.1:{port}",
                        start_timeout=60, stop_timeout=30, stop_signal=PEER_STOP_SIGNAL)
    start = time.monotonic()
    assert srv.stop() == -PEER_STOP_SIGNAL and time.monotonic() - start < 10


def test_a_server_that_dies_early_is_reported_with_its_log():
    with pytest.raises(RuntimeError, match=r"exited with code 3[\s\S]*no model here"):
        ServerProcess([sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"],
                      "http://127.0.0.1:9", start_timeout=30)


def test_a_server_that_never_answers_times_out_and_is_stopped():
    with pytest.raises(RuntimeError, match="did not answer"):
        ServerProcess([sys.executable, "-c", "import time; time.sleep(600)"],
                      f"http://127.0.0.1:{free_port()}", start_timeout=1.0)


@pytest.mark.parametrize("bad, why", [(["--rates", "fast"], "--rates"),
                                       (["--rates", "0"], "> 0"),
                                       (["--num-prompts", "0"], ">= 1"),
                                       (["--peer", "transformers", "--url", "http://x"], "--url")])
def test_bad_options_are_named(bad, why, capsys):
    with pytest.raises(SystemExit) as e:
        bench(bad)
    assert e.value.code == 2 and why in capsys.readouterr().err


def _bench(tmp_path, *extra: str) -> dict:
    out = tmp_path / "out"
    rc = bench(["--num-prompts", "6", "--input-len", "24", "--output-len", "5",
                "--rates", "50,inf", "--low-load-prompts", "3", "--max-num-seqs", "8",
                "--threads", "1", "--out", str(out), *extra])
    assert rc == 0
    assert (out / "latency_vs_load.png").stat().st_size > 1000
    return json.loads((out / "bench.json").read_text())


PEER_MISSING = peer_available("transformers")  # None, or why transformers serve cannot run


@pytest.fixture(scope="module")
def chat_bench(tmp_path_factory) -> dict:
    """One bench run on the chat dataset, beside transformers serve where its dependencies are
    installed: the two tests below read it (each server's start and runs are the cost)."""
    peer = [] if PEER_MISSING else ["--peer", "transformers", "--device", "cpu"]
    return _bench(tmp_path_factory.mktemp("bench"), "--dataset", "chat", *peer)


@pytest.mark.slow
def test_bench_end_to_end_with_a_server_process(chat_bench):
    report = chat_bench
    ours = report["servers"]["ours"]
    assert [r["rate"] for r in ours["rows"]] == ["50.0", "inf"]
    assert all(r["completed"] == 6 and r["failed"] == 0 for r in ours["rows"])
    assert ours["low_load"]["completed"] == 3
    # the same work as the offline engine: every output token asked for
    for r in ours["rows"]:
        assert round(r["output_throughput"] * r["duration_s"]) == report["offline"]["output_tokens"]
    ratios = report["ratios"]
    assert ratios["prefill_p50_ms"] > 0 and ratios["low_load_ttft_p50_ms"] > 0
    assert ratios["ttft_minus_prefill_ms"] == pytest.approx(
        ratios["low_load_ttft_p50_ms"] - ratios["prefill_p50_ms"])
    assert ratios["http_over_offline_throughput"] > 0


@pytest.mark.slow
@pytest.mark.skipif(PEER_MISSING is not None,
                    reason="transformers serve's dependencies are not installed")
def test_bench_with_the_transformers_peer(chat_bench):
    report = chat_bench
    peer = report["servers"]["transformers"]
    assert all(r["failed"] == 0 for r in peer["rows"])
    ratio = report["ratios"]["ours_over_transformers"]
    assert [r["rate"] for r in ratio] == ["50.0", "inf"]
    assert all(r["output_throughput"] > 0 and r["ttft_p50"] > 0 for r in ratio)


def test_peer_command_gets_our_kv_pool_and_the_same_directory(tmp_path):
    from layer6_serving.bench.peer import model_dir, peer_command

    path = model_dir("course", tmp_path)
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    kv = {"block_size": 16, "num_blocks": 777, "max_batch_tokens": 2048, "cuda_graph": False}
    cmd, env, name = peer_command("transformers", path, 4321, device="cuda", dtype="bfloat16",
                                  kv=kv)
    assert name == str(path) and str(path) in cmd and env["HF_HUB_OFFLINE"] == "1"
    def flag(name: str) -> str:
        return cmd[cmd.index(name) + 1]
    assert flag("--port") == "4321" and flag("--cb-num-blocks") == "777"
    assert flag("--cb-block-size") == "16" and flag("--dtype") == "bfloat16"
    assert "--continuous-batching" in cmd and "--no-cb-use-cuda-graph" in cmd
    with pytest.raises(ValueError, match="Hugging Face directory"):
        model_dir(str(tmp_path / "nothing"), tmp_path)


DYING = """
import http.server, os, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def do_POST(self):
        print("dying on a request", flush=True); os._exit(3)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_server_that_dies_under_load_stops_the_run_with_its_log():
    import argparse

    from layer6_serving.bench.dataset import BenchRequest
    from layer6_serving.bench.serving import drive

    port = free_port()
    args = argparse.Namespace(seed=0, rates=[float("inf")], max_concurrency=None, repeats=1,
                              slo_ttft_ms=None, slo_tpot_ms=None)
    reqs = [BenchRequest(prompt_ids=[1, 2], max_tokens=2, prompt="x")]
    with ServerProcess([sys.executable, "-c", DYING, str(port)], f"http://127.0.0.1:{port}",
                       start_timeout=60) as srv:
        with pytest.raises(RuntimeError, match=r"exited \(code 3\) during the warm-up[\s\S]*dying"):
            drive("ours", srv.url, "m", reqs, reqs, reqs, args, server=srv)
