"""symmetric_group: a rendezvous group's store renumbers torch's process-wide exchange counter,
so a process that rendezvoused before meets fresh ones (the exchange is emulated on CPUs:
torch's CUDA symmetric memory needs GPUs; tests/layer2/test_peer_all_reduce.py runs the real
one there)."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from layer2_comm import launch
from layer2_comm import symmetric_group as sg

# 13 ranks; each rank's history of exchanges is emulated (_meet's `earlier`), not inherited
pytestmark = pytest.mark.usefixtures("fork_server_module")


def _exchange(store, rank: int, world: int, seq: int, value: int, timeout_s: float = 30.0):
    """What torch's StoreExchange.all_gather does (2.11): set my key under the PROCESS's
    counter, then wait for and read every peer's key under the same counter."""
    keys = [f"CUDASymmetricMemory/{seq}/{r}" for r in range(world)]
    store.set(keys[rank], str(value))
    out = []
    for r in range(world):
        if r != rank:
            store.wait([keys[r]], timedelta(seconds=timeout_s))
        out.append(int(store.get(keys[r])) if r != rank else value)
    return out


def _store(group, name: str):
    """The store torch's C++ gets from the group (older torch: the one the group was made with)."""
    if hasattr(group, "get_group_store"):
        return group.get_group_store()
    return sg._groups[name][1]


def test_keys_are_renumbered_in_the_order_this_process_meets_them():
    store = sg.RenumberingStore(dist.HashStore())
    assert store.key("CUDASymmetricMemory/2/1") == "CUDASymmetricMemory/0/1"
    assert store.key("CUDASymmetricMemory/2/0") == "CUDASymmetricMemory/0/0"
    assert store.key("CUDASymmetricMemory/3/0") == "CUDASymmetricMemory/1/0"
    assert store.key("Other/7/0") == "Other/0/0"  # a counter per prefix
    assert store.key("plain") == "plain" and store.key("a/b/c") == "a/b/c"
    store.set("CUDASymmetricMemory/3/1", b"x")
    assert store.get("CUDASymmetricMemory/3/1") == b"x"
    assert store.inner.get("CUDASymmetricMemory/1/1") == b"x"


def _meet(earlier: int, renumber: bool) -> list:
    """Rank r has made 2*r*earlier exchanges before (rank 0 none: fresh), as a process that
    hosted earlier engines; then every rank rendezvouses over a new group, twice (torch's
    request swap and its closing barrier)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sg._next[0] = 5 * rank  # the group numbers are per process too
    name = sg.rendezvous_group(dist.group.WORLD, torch.device("cpu"))
    group = c10d._resolve_process_group(name)  # as torch's C++ finds it
    store = _store(group, name) if renumber else _store(group, name).inner
    seq = 2 * rank * earlier
    try:
        got = [_exchange(store, rank, world, seq + i, 10 * rank + i, 30.0 if renumber else 2.0)
               for i in range(2)]
    except (RuntimeError, dist.DistStoreError) as exc:
        got = [f"timeout: {type(exc).__name__}"]
    sg.release(name)
    return [name, group.rank(), group.size(), got]


@pytest.mark.parametrize("earlier", [0, 1, 3])
def test_processes_with_different_histories_meet_on_a_new_group(earlier):
    out = launch(_meet, 3, earlier, True, backend="gloo", timeout_s=60)
    assert len({name for name, *_ in out}) == 1, out  # every rank the same new name
    assert out[0][0] == "symmetric-memory-10", out  # above every number any rank used
    for rank, (_, grank, size, got) in enumerate(out):
        assert (grank, size) == (rank, 3), out
        assert got == [[0, 10, 20], [1, 11, 21]], out


def test_without_renumbering_such_processes_wait_for_keys_never_written():
    out = launch(_meet, 2, 1, False, backend="gloo", timeout_s=60)
    assert all(str(got[0]).startswith("timeout") for *_, got in out), out


def _gloo_over_the_store() -> float:
    """A C++ user of the store (gloo's rendezvous) through our Python overrides."""
    name = sg.rendezvous_group(dist.group.WORLD, torch.device("cpu"))
    group = c10d._resolve_process_group(name)
    pg = dist.ProcessGroupGloo(_store(group, name), group.rank(), group.size(),
                               timedelta(seconds=30))
    x = torch.tensor([float(dist.get_rank() + 1)])
    pg.allreduce([x]).wait()
    sg.release(name)
    return float(x)


def test_cpp_callers_reach_the_python_store():
    assert launch(_gloo_over_the_store, 2, backend="gloo", timeout_s=60) == [3.0, 3.0]
