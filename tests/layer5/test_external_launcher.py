"""distributed_executor_backend="external_launcher": torchrun starts every rank, each runs
the same script. Two "nodes" on this machine (two torchrun processes meeting at a c10d
rendezvous on 127.0.0.1, one rank each, gloo): rank 0's tokens equal one process's, every
rank returns; a rank that never builds its engine is named on rank 0 within the timeout and
every process ends."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import layer5_parallel as l5

SCRIPT = Path(__file__).with_name("external_launcher_script.py")
PROMPTS = ["ROMEO.\n", "JULIET.\nO Romeo, Romeo", "HAMLET.\nTo be, or not to be", "KING LEAR.\n"]


def two_nodes(tmp_path: Path, *extra: str, limit_s: float = 420.0,
              until_output: bool = False) -> tuple[list, str, Path]:
    """Start two torchrun 'nodes' of one rank each; wait for both (or, until_output, for rank
    0's output file), killing whatever still runs past limit_s or at the end."""
    port = l5.free_port()
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
           "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-conf", "join_timeout=120", "--max-restarts", "0", str(SCRIPT), str(out),
           *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    procs = [subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                              start_new_session=True) for log in logs]
    deadline = time.monotonic() + limit_s
    try:
        while time.monotonic() < deadline:
            if all(p.poll() is not None for p in procs) or (until_output and out.exists()):
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return [p.returncode for p in procs], "\n".join(log.read_text() for log in logs), out


def test_two_nodes_equal_one_process(tmp_path):
    codes, log, out = two_nodes(tmp_path)
    assert codes == [0, 0], log
    got = json.loads(out.read_text())
    ref = l5.LLM(l5.course_model_dir("target"), dtype="float32", device="cpu",
                 num_blocks=64)
    params = l5.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params)]
    assert got["tokens"] == want
    assert got["blocks"] == 64 and all(len(t) == 8 for t in got["sampled"])
    assert log.count("returned") == 2, log  # every rank returned from generate()


def test_a_rank_that_never_arrives_is_named_within_the_timeout(tmp_path):
    _, log, out = two_nodes(tmp_path, "--absent-rank", "1", until_output=True)
    assert out.exists(), log
    got = json.loads(out.read_text())
    assert "rank(s) [1] of 2 did not reach" in got["error"] and "within 5 s" in got["error"], got
    assert got["waited_s"] < 5 + 30, got  # the 5 s timeout, plus joining torchrun's store


def test_launcher_mistakes_are_named_before_anything_starts(monkeypatch):
    from layer5_parallel.tensor_parallel.external_launcher import LaunchedGroup

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="started by torchrun.*RANK, WORLD_SIZE"):
        LaunchedGroup(2, "cpu", "torch", False, 5.0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match="started 4 ranks.*tensor_parallel_size=2"):
        LaunchedGroup(2, "cpu", "torch", False, 5.0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="local rank 1 on its host, which has 1 GPU"):
        LaunchedGroup(2, "cuda", "torch", False, 5.0)
    with pytest.raises(ValueError, match="tp_backend='torch'"):
        LaunchedGroup(2, "cpu", "ours", False, 5.0)


def test_more_ranks_than_gpus_is_refused_before_any_process_starts(monkeypatch):
    from layer5_parallel.runtime import WorkerGroup

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="size 4 on CUDA needs 4 GPUs.*2 are visible"):
        WorkerGroup.start(4, ("path", "unused", "torch", None), device=torch.device("cuda"),
                          build=None)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("tp-rank")]
