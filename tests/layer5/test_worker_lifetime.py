"""Workers never outlive rank 0. A rank 0 killed without its teardown (SIGKILL, or `timeout`'s
SIGTERM, or pytest-timeout's os._exit) used to leave its workers running, holding their GPU
memory: here a TP=2 engine on gloo runs in a process of its own, that process is killed, and
every worker must be gone within a few seconds: one stuck mid-step (not reading its messages),
also when rank 0 started it from a thread other than its main one (no parent-death signal
then: the watchdog thread finds it); and `timeout`'s SIGTERM ends rank 0 at once (the default
action: no handler that would wait for a busy main thread) and its workers follow."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = r"""
import json, sys, threading, time
import layer5_parallel as l5
l3 = l5.engine.executor
mode = sys.argv[1]
config = l3.ModelConfig(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, max_position_embeddings=64)
model = l3.Model(l3.random_model(config, seed=0))
faults = {1: "hang"} if mode != "idle" else None
box = {}
def start():
    box["llm"] = l5.LLM(model, tensor_parallel_size=2, num_blocks=16, block_size=8,
                        max_num_seqs=2, tp_timeout_s=120, tp_threads=1, _tp_faults=faults)
if mode == "thread":  # started from a helper thread: no PDEATHSIG, the watchdog alone
    t = threading.Thread(target=start)
    t.start()
    t.join()
else:
    start()
llm = box["llm"]
print(json.dumps([p.pid for p in llm.tp_group.procs]), flush=True)
if mode != "idle":  # rank 1 sleeps inside its first step; rank 0 waits for it
    llm.generate([[1, 2, 3]], l5.SamplingParams(max_tokens=2))
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """No such process, or a zombie (dead; its reaper is not ours)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _run_and_kill(mode: str, sig: int) -> tuple[list[int], float, subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"the engine did not start: {proc.stderr.read()[-2000:]}")
        pids = json.loads(line)
        assert len(pids) == 1 and not _gone(pids[0])
        time.sleep(1.0)  # hang: rank 1 is asleep in its step by now
        proc.send_signal(sig)
        proc.wait(10)
        start = time.monotonic()
        while time.monotonic() - start < 30 and not all(_gone(p) for p in pids):
            time.sleep(0.05)
        return pids, time.monotonic() - start, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("mode", ["hang", "thread"])  # thread: hangs too
def test_workers_die_when_rank0_is_killed(mode):
    pids, waited, _ = _run_and_kill(mode, signal.SIGKILL)
    alive = [p for p in pids if not _gone(p)]
    for p in alive:  # don't leave them behind, whatever the verdict
        os.kill(p, signal.SIGKILL)
    # gone within _run_and_kill's 30 s: the watchdog checks every 0.5 s, and a hung worker
    # left alone would sleep on (a tighter bound would time a busy machine, not the watchdog)
    assert not alive, f"{mode}: worker(s) {alive} outlived rank 0 by {waited:.1f} s"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_ends_rank0_at_once_and_its_workers_follow():
    pids, waited, proc = _run_and_kill("idle", signal.SIGTERM)
    alive = [p for p in pids if not _gone(p)]
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert not alive, (alive, waited)
    assert proc.returncode == -signal.SIGTERM, proc.returncode
