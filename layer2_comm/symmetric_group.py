"""A process group torch symmetric memory can rendezvous on, even in a process that already did.

Torch symmetric memory remembers, per group NAME, the group's store, rank and size, for the
life of the process. But names are handed out again: destroy_process_group() resets the
counter, so the next default group is "0" again. A process that hosts one engine, closes it
and starts another (the tensor-parallel bench does: TP=2, then TP=4, all in rank 0's
process) would rendezvous the second engine's buffers through the first one's dead store
and size, while the fresh worker processes wait on the new store: every rank hangs.

So each process remembers which group object each name belonged to when it was used for
symmetric memory; if any rank has seen the name for another group, every rank moves on to a
new group over the same ranks (a new name) and asks again, until no rank has seen the name.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# group name -> the process group symmetric memory cached it for, in this process
_USED: dict[str, object] = {}


def symmetric_group(group, device: torch.device):
    """`group` itself when no rank has used its name for another group before, else a new
    group over the same ranks with a name no rank has used (then collective over the
    default group, as dist.new_group is). Every rank of `group` calls it, in the same order."""
    ranks = dist.get_process_group_ranks(group)
    while True:
        seen = _USED.get(group.group_name, group) is not group
        flag = torch.tensor([int(seen)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not int(flag.item()):
            _USED[group.group_name] = group
            return group
        group = dist.new_group(ranks)
