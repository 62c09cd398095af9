"""A group of its own for each torch symmetric memory rendezvous, so that a process that has
rendezvoused before can still meet processes that have not.

Torch's CUDA symmetric memory (2.11) swaps each rendezvous' metadata through the group's
store, under keys "CUDASymmetricMemory/<seq>/<rank>" where seq counts the exchanges the
whole PROCESS has made (two per rendezvous), not the group's: every rank must have made
the same number of them before. A tensor-parallel engine's rank 0 lives in the process
that started it, its workers are new processes. After a first engine, rank 0 is at seq 2
and the second engine's workers at 0: each waits for a key the other never writes, until
the store's timeout (a second engine in one process; the bench's TP=2 then TP=4). Newer
torch counts per group store.

So every rendezvous runs over a group made for it: a name no rank has used, registered
where torch looks groups up by name, whose store renumbers those seqs from 0 in the order
this rank meets them. Every rank of the group makes the same exchanges in the same order,
so the renumbered keys agree whatever each process did before. (A fresh name also keeps
away from what torch caches per group name for the life of the process.)
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# "<prefix>/<seq>/<rest>": how torch's store exchanges name their keys
_SEQ_KEY = re.compile(r"^([^/]+)/(\d+)/(.+)$")
_next = [0]  # the number of this process's next rendezvous group (never reused)
# torch's registry holds a group weakly, and a store's Python methods live only as long as
# its Python object: this keeps both
_groups: dict[str, tuple] = {}


class RenumberingStore(dist.Store):
    """A store over `inner` that renumbers <seq> in keys "<prefix>/<seq>/<rest>": the first
    seq this process uses under a prefix becomes 0, the next one 1, and so on. Other keys
    pass through."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner
        self._seqs: dict[str, dict[str, int]] = {}

    def key(self, key: str) -> str:
        match = _SEQ_KEY.match(key)
        if match is None:
            return key
        prefix, seq, rest = match.groups()
        seqs = self._seqs.setdefault(prefix, {})
        return f"{prefix}/{seqs.setdefault(seq, len(seqs))}/{rest}"

    def set(self, key, value):
        self.inner.set(self.key(key), value)

    def get(self, key):
        return self.inner.get(self.key(key))

    def add(self, key, amount):
        return self.inner.add(self.key(key), amount)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(self.key(key), expected, desired)

    def check(self, keys):
        return self.inner.check([self.key(k) for k in keys])

    def wait(self, keys, timeout=None):
        keys = [self.key(k) for k in keys]
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def multi_get(self, keys):
        return self.inner.multi_get([self.key(k) for k in keys])

    def multi_set(self, keys, values):
        self.inner.multi_set([self.key(k) for k in keys], values)

    def delete_key(self, key):
        return self.inner.delete_key(self.key(key))

    def num_keys(self):
        return self.inner.num_keys()


def rendezvous_group(group, device: torch.device) -> str:
    """Register a group over `group`'s ranks for one symmetric-memory rendezvous and return
    its name (pass it to symm_mem.rendezvous; `release` it when done). Collective: every
    rank of `group` calls it at the same point (one small all-reduce on `device`)."""
    number = torch.tensor([_next[0]], device=device)
    dist.all_reduce(number, op=dist.ReduceOp.MAX, group=group)  # a number no rank has used
    _next[0] = int(number.item()) + 1
    name = f"symmetric-memory-{_next[0] - 1}"
    store = RenumberingStore(dist.PrefixStore(name, c10d._get_process_group_store(group)))
    # no backend: the rendezvous only asks the group for its rank, size and store
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    members = c10d.ProcessGroup(store, rank, size)
    c10d._register_process_group(name, members)
    # some torch versions read the rank, size and store from this table instead
    from torch._C._distributed_c10d import _SymmetricMemory
    _SymmetricMemory.set_group_info(name, rank, size, store)
    _groups[name] = (members, store)
    return name


def release(name: str) -> None:
    """Forget a group from rendezvous_group."""
    if _groups.pop(name, None) is not None:
        c10d._unregister_process_group(name)
