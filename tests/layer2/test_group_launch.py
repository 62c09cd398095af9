"""Process groups: launch() runs a function on N ranks and returns each rank's value;
init() reads the env:// variables torchrun sets, and alone makes a world of one."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import layer2_comm
from layer2_comm import (
    broadcast_tree,
    destroy,
    device,
    init,
    launch,
    local_rank,
    rank,
    ring_all_gather,
    ring_all_reduce,
    tree_all_reduce,
    world_size,
)
from layer2_comm.group import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def whoami(scale: int) -> dict:
    """What a rank knows about itself, plus a tensor, to check values come back."""
    return {"rank": rank(), "world": world_size(), "local_rank": local_rank(),
            "device": str(device()), "backend": torch.distributed.get_backend(),
            "env": {k: os.environ.get(k) for k in ENV_KEYS},
            "tensor": torch.arange(3) * rank() * scale}


def test_launch_returns_each_ranks_value_in_rank_order():
    start = time.monotonic()
    out = launch(whoami, 2, 10, backend="gloo", timeout_s=120)  # start-up under load included
    assert [o["rank"] for o in out] == [0, 1]
    assert {o["world"] for o in out} == {2} and [o["local_rank"] for o in out] == [0, 1]
    assert {o["device"] for o in out} == {"cpu"} and {o["backend"] for o in out} == {"gloo"}
    ports = {o["env"]["MASTER_PORT"] for o in out}
    assert len(ports) == 1 and {o["env"]["MASTER_ADDR"] for o in out} == {"127.0.0.1"}
    assert [o["env"]["RANK"] for o in out] == ["0", "1"]
    for r, o in enumerate(out):
        assert torch.equal(o["tensor"], torch.arange(3) * r * 10)
    assert time.monotonic() - start < 120


def test_launch_checks_its_arguments():
    with pytest.raises(ValueError, match="world_size"):
        launch(whoami, 0, 1, backend="gloo")
    with pytest.raises(ValueError, match="backend"):
        launch(whoami, 2, 1, backend="mpi")


def test_init_alone_is_a_world_of_one():
    """In a plain process (no RANK/WORLD_SIZE) every collective is the identity."""
    saved = dict(os.environ)
    for key in ENV_KEYS:
        os.environ.pop(key, None)
    try:
        assert init("gloo", timeout_s=10) == "gloo"
        assert init("gloo") == "gloo"  # a second call is harmless
        assert (rank(), world_size(), local_rank(), device()) == (0, 1, 0, torch.device("cpu"))
        x = torch.arange(5.0)
        assert torch.equal(ring_all_reduce(x.clone(), "avg", chunks=2), x)
        assert torch.equal(tree_all_reduce(x.clone(), "max"), x)
        assert torch.equal(ring_all_gather(x), x)
        assert torch.equal(broadcast_tree(x.clone()), x)
    finally:
        destroy()
        os.environ.clear()
        os.environ.update(saved)
    assert not torch.distributed.is_initialized()


def test_init_names_missing_environment_variables(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT"):
        init("gloo", timeout_s=5)


def test_public_api_is_exported():
    for name in ("init", "destroy", "rank", "world_size", "local_rank", "device", "launch",
                 "ring_all_reduce", "tree_all_reduce", "ring_all_gather", "ring_reduce_scatter",
                 "broadcast_tree", "broadcast_chain", "all_to_all", "hierarchical_all_reduce"):
        assert name in layer2_comm.__all__ and callable(getattr(layer2_comm, name))


TORCHRUN_SCRIPT = """
import os, torch
from layer2_comm import init, destroy, rank, world_size, local_rank, ring_all_reduce, broadcast_chain
assert init(backend="gloo", timeout_s=120) == "gloo"  # a net: room for a busy machine
assert (world_size(), local_rank()) == (2, int(os.environ["LOCAL_RANK"]))
x = torch.full((7,), float(rank() + 1))
ring_all_reduce(x, chunks=2)
assert x.tolist() == [3.0] * 7, x
y = torch.arange(5) if rank() == 1 else torch.zeros(5, dtype=torch.int64)
assert broadcast_chain(y, src=1, chunks=2).tolist() == [0, 1, 2, 3, 4]
destroy()
print("rank", rank(), "ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("torch.distributed.run") is None,
                    reason="torchrun (torch.distributed.run) is not available")
def test_torchrun_runs_a_collective(tmp_path: Path):
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(TORCHRUN_SCRIPT))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for key in ENV_KEYS:
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
