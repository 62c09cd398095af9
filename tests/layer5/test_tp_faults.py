"""A tensor-parallel engine whose worker dies or sends a mismatched shape fails clearly, fast.

Faults are injected into worker rank 1 (`_tp_faults`, a test hook): "die" exits at the first
step, "shape" all-reduces a tensor one row too long. Rank 0 must raise one RuntimeError that
names what happened on each rank, well within the group's timeout, stop the workers and leave
the process group (so a new engine can start in this process).
"""
from __future__ import annotations

import multiprocessing
import time

import pytest
import torch.distributed as dist

import layer5_parallel as l5

from .engine_checks import tiny_model

# The group's timeout: every wait is bounded by it, the workers' start too (past 30 s on a
# busy machine); the faults are found from what happened (the texts say), not by it.
TIMEOUT_S = 60.0


def fail_once(fault: str, **kw) -> tuple[str, float]:
    llm = l5.LLM(tiny_model(1), tensor_parallel_size=2, num_blocks=16, block_size=4,
                 tp_timeout_s=TIMEOUT_S, _tp_faults={1: fault}, **kw)
    params = l5.SamplingParams(temperature=0.0, max_tokens=3)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        llm.generate([[1, 2, 3], [4, 5]], params)
    elapsed = time.monotonic() - start
    with pytest.raises(RuntimeError, match="is closed: tensor-parallel forward step failed"):
        llm.generate([[1, 2, 3]], params)
    llm.close()
    with pytest.raises(RuntimeError, match="is closed"):  # closed stays closed, no hang
        llm.generate([[1, 2, 3]], params)
    assert not dist.is_initialized()  # the group was left: another engine may start
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("l5-rank")]
    return str(info.value), elapsed


def test_dead_worker_is_named_within_the_timeout():
    msg, elapsed = fail_once("die")
    assert "rank 1" in msg and "exit" in msg and "code 3" in msg, msg
    assert elapsed < TIMEOUT_S  # found by the liveness check or the broken connection, not a hang


@pytest.mark.parametrize("backend,check", [("ours", False), ("torch", True)])
def test_mismatched_shape_raises_on_both_ranks(backend, check):
    msg, elapsed = fail_once("shape", tp_backend=backend, tp_check=check)
    lines = msg.splitlines()
    assert "rank 0" in lines[0] and "ValueError" in lines[0], msg  # rank 0's own error
    assert any(line.startswith("rank 1: ValueError") for line in lines[1:]), msg  # and rank 1's
    assert elapsed < TIMEOUT_S


def test_start_up_limit_is_named_as_the_start_up_limit():
    """A rank that never comes up (joins the group, then hangs before building its shard) is
    reported when the start-up limit runs out, named as that limit, not the step limit; and
    every worker is gone. (A hang mid-step names the step limit: test_tp_graph.py.)"""
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        l5.LLM(tiny_model(1), tensor_parallel_size=2, num_blocks=16, block_size=4,
               tp_start_timeout_s=3.0, tp_timeout_s=TIMEOUT_S, _tp_faults={1: "start-hang"})
    elapsed = time.monotonic() - start
    msg = str(info.value)
    assert "the start-up limit of 3 s (tp_start_timeout_s)" in msg, msg
    assert "step limit" not in msg, msg
    assert elapsed < TIMEOUT_S, elapsed
    assert not dist.is_initialized()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("l5-rank")]


def test_the_start_up_limit_is_the_step_limit_unless_set():
    config = l5.EngineConfig(tensor_parallel_size=2, tp_timeout_s=7.0)
    assert config.start_timeout_s == 7.0  # as before the two were apart
    assert l5.EngineConfig(tp_timeout_s=7.0, tp_start_timeout_s=90.0).start_timeout_s == 90.0
    for bad in (0, -1.0, float("inf"), float("nan"), True, "30"):
        with pytest.raises(ValueError, match="tp_start_timeout_s must be a finite number > 0"):
            l5.EngineConfig(tp_start_timeout_s=bad)
        with pytest.raises(ValueError, match="tp_timeout_s must be a finite number > 0"):
            l5.EngineConfig(tp_timeout_s=bad)
