"""distributed_executor_backend="external_launcher": torchrun starts every rank, each runs
the same script. Two "nodes" on this machine (two torchrun processes meeting at a c10d
rendezvous on 127.0.0.1, one rank each, gloo): rank 0's tokens equal one process's, every
rank returns; a rank that never builds its engine is named on rank 0 within the timeout and
every process ends."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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
    assert "rank(s) [1] of 2 did not reach" in got["error"] and "15 s" in got["error"], got
    assert got["waited_s"] < 15 + 30, got  # the 15 s timeout, plus joining torchrun's store
