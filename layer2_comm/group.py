"""Process groups: one process per rank, joined by an env:// rendezvous.

Every rank runs the same program. `init()` reads who it is from the environment —
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCAL_RANK, exactly what `torchrun` sets
(and what `launch()` sets for its children) — and meets the others at MASTER_ADDR:PORT,
where rank 0 hosts a small key-value store. Multi-node runs therefore go through torchrun's
rendezvous; nothing here knows about hosts.

Backends: NCCL moves CUDA tensors between GPUs (NVLink, PCIe, InfiniBand); gloo moves CPU
tensors over TCP. "auto" picks NCCL when CUDA is visible, else gloo. With NCCL each rank
drives the GPU numbered LOCAL_RANK.

The timeout given to `init()` bounds every wait in this package: the rendezvous, gloo's
receives (the collectives pass it to `Work.wait`), and NCCL's watchdog, which aborts a
communicator whose operation has not finished within it.

Side groups, over the same ranks, made once (by every rank at the same point):
- `control_group()`: a gloo group for the small headers the collectives swap before moving
  data. Under NCCL a header on the GPU would have to come back to the host to be compared
  (`.tolist()` waits for everything queued on the GPU); on the CPU it never waits for the GPU.
- `lane_groups(n)`: n groups to stripe large messages over (see tuning.py): under NCCL
  each is its own communicator, with its own CUDA stream and thread blocks.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("auto", "gloo", "nccl")
# NVLink SHARP / multicast is off on the machines this course measures on (NCCL, torch's
# symmetric memory and NVSHMEM each have a switch); kept off unless the user says otherwise.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
_state = {"timeout_s": 60.0}
# this world's side groups
_side: dict = {"world": None, "control": None, "lanes": [], "warm": False}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it), for a local rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def resolve_backend(backend: str) -> str:
    """Map "auto" to "nccl" when CUDA is visible, else "gloo"; check other names."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend 'nccl' needs a CUDA GPU and none is "
                           "visible; use 'gloo' on CPUs")
    return backend


def init(backend: str = "auto", *, timeout_s: float = 60.0) -> str:
    """Join the process group described by the environment; returns the backend used.

    Without RANK/WORLD_SIZE in the environment (a notebook, a plain `python` run) this
    process becomes a group of one on 127.0.0.1. Calling it again is harmless.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_backend()
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    backend = resolve_backend(backend)
    env = os.environ
    if "RANK" not in env and "WORLD_SIZE" not in env:  # a lone process: a world of one
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(free_port()))
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise ValueError(f"init(): the environment lacks {', '.join(missing)}; run under torchrun "
                         "or launch(), which set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
    if backend == "nccl":
        for key, value in MULTICAST_OFF.items():
            env.setdefault(key, value)
        if local_rank() >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={local_rank()} but only {torch.cuda.device_count()} "
                               "GPUs are visible")
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    _state["timeout_s"] = float(timeout_s)
    return backend


def destroy() -> None:
    """Leave the process group (a no-op when not in one), side groups included."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _side.update(world=None, control=None, lanes=[], warm=False)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank: 0 .. world_size()-1."""
    return dist.get_rank() if is_initialized() else int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """How many ranks are in the group."""
    return dist.get_world_size() if is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    """This process's index on its own machine (the GPU it drives with NCCL)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def backend() -> str:
    """The backend in use ("gloo" or "nccl"); before init(), what "auto" would pick."""
    return dist.get_backend() if is_initialized() else resolve_backend("auto")


def device() -> torch.device:
    """Where this rank's tensors live: its GPU under NCCL, else the CPU."""
    if backend() == "nccl":
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def barrier(dev: torch.device | None = None) -> None:
    """dist.barrier, told which GPU this rank drives under NCCL (else it has to guess)."""
    dev = dev or device()
    if dev.type == "cuda":
        dist.barrier(device_ids=[dev.index or 0])
    else:
        dist.barrier()


def timeout_s() -> float:
    """The timeout given to init(): the longest any wait in this package lasts."""
    return _state["timeout_s"]


def _side_groups() -> dict:
    """This world's side groups (forgotten when the process group was destroyed and re-made)."""
    if _side["world"] is not dist.group.WORLD:
        _side.update(world=dist.group.WORLD, control=None, lanes=[], warm=False)
    return _side


def control_group():
    """The group headers travel on: gloo, so they are CPU tensors and never wait on a GPU.

    Under gloo that is the default group (returned as None). Under NCCL a gloo group over
    the same ranks is made on first use — by every rank, since the collectives ask for it
    at the same point — and kept.
    """
    if backend() == "gloo":
        return None
    side = _side_groups()
    if side["control"] is None:
        side["control"] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s()))
    return side["control"]


def lane_groups(n: int) -> list:
    """``n`` process groups over every rank to stripe large messages over; lane 0 is the default
    group (None). Extra lanes are made on first use: every rank must ask at the same point,
    which `p2p.agree` (every collective, before data moves) sees to.

    Under NCCL the first call also warms up the default group's communicator (see _warm_up):
    once headers travel on gloo, nothing else guarantees every rank takes part in its first use.
    """
    if world_size() < 2:
        return [None]
    side = _side_groups()
    if not side["warm"]:
        if backend() == "nccl":
            _warm_up(None)
        side["warm"] = True
    while len(side["lanes"]) < n - 1:
        lane = dist.new_group(backend=backend(), timeout=timedelta(seconds=timeout_s()))
        if backend() == "nccl":
            _warm_up(lane)
        side["lanes"].append(lane)
    return [None, *side["lanes"][: max(0, n - 1)]]


def _warm_up(lane) -> None:
    """Make an NCCL group's communicator now, with every rank taking part.

    NCCL builds a communicator at a group's first operation and needs every rank of the group
    in that call. A collective may use a group only between some ranks (an all-to-all with
    empty splits, a tree's first level, a striped message between two neighbours), so a rank
    that has nothing to send would leave the others waiting. One ring exchange of a single
    element, by every rank, settles it.
    """
    p, me = world_size(), rank()
    out, into = torch.zeros(1, device=device()), torch.empty(1, device=device())
    ops = [dist.P2POp(dist.isend, out, (me + 1) % p, group=lane),
           dist.P2POp(dist.irecv, into, (me - 1) % p, group=lane)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
