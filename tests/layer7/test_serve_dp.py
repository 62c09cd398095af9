"""`stack serve --dp N`: N layer-6 servers behind one router (layer7_app/router/data_parallel.py).

The argument split and the GPU plan are checked as functions; one end-to-end run starts two
course-model replicas on the CPU behind the router on a free port, sends completions through
it, and checks both replicas answered and every process is gone afterwards.
"""
from __future__ import annotations

import socket

import httpx
import pytest

from layer7_app.router import data_parallel as dp


def test_split_args_keeps_the_replicas_options():
    args, rest = dp.split_args(["--model", "course", "--dp", "2", "--tp", "2", "--port", "9",
                                "--num-blocks", "64"])
    assert (args.dp, args.tp, args.pp, args.port, args.policy) == (2, 2, 1, 9, "least_loaded")
    assert rest == ["--model", "course", "--tp", "2", "--num-blocks", "64"]


def test_gpu_plan_and_bad_sizes():
    assert dp.replica_gpus(2, 1, 2) == ["0", "1"]
    assert dp.replica_gpus(2, 2, 4) == ["0,1", "2,3"]
    assert dp.replica_gpus(3, 1, 0) == [None, None, None]  # no GPUs: CPU replicas
    with pytest.raises(ValueError, match="--dp 2 replicas x 2 GPU"):
        dp.replica_gpus(2, 2, 2)
    with pytest.raises(ValueError, match="--dp must be >= 1"):
        dp.replica_gpus(0, 1, 2)


def test_bad_dp_is_one_line_and_exit_2(capsys):
    assert dp.serve_dp_main(["--dp", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --dp must be >= 1")


@pytest.mark.timeout(600)
def test_two_cpu_replicas_behind_one_router(monkeypatch):
    monkeypatch.setattr(dp, "_gpu_count", lambda: 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stopped = {}

    def fake_wait(handle):  # instead of waiting for Ctrl-C: drive the router, then stop
        try:
            url = f"http://127.0.0.1:{port}/v1/completions"
            body = {"model": "course", "prompt": "ROMEO.\n", "max_tokens": 3, "temperature": 0}
            texts = [httpx.post(url, json=body, timeout=120).json()["choices"][0]["text"]
                     for _ in range(4)]
            stopped["texts"] = texts
            stopped["replicas"] = httpx.get(f"http://127.0.0.1:{port}/router/replicas",
                                            timeout=10).json()
        finally:
            handle.stop()

    monkeypatch.setattr(dp.l6, "run_until_interrupted", fake_wait)
    procs = []
    real_start = dp.start_replicas

    def start(*a, **kw):
        out = real_start(*a, **kw)
        procs.extend(out[0])
        return out

    monkeypatch.setattr(dp, "start_replicas", start)
    code = dp.serve_dp_main(["--model", "course", "--dp", "2", "--port", str(port),
                             "--policy", "round_robin", "--num-blocks", "64", "--engine-thread"])
    assert code == 0
    assert len(set(stopped["texts"])) == 1  # greedy: every replica gives the same completion
    assert [r["served"] for r in stopped["replicas"]["replicas"]] == [2, 2]
    assert len(procs) == 2 and all(p.poll() is not None for p in procs)


def test_layer_6_alone_points_to_stack_serve(capsys):
    assert dp.l6.serve_main(["--dp", "2"]) == 2
    assert "stack serve --dp N" in capsys.readouterr().err
