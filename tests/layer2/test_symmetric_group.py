"""symmetric_group: a name torch symmetric memory has cached for another group is never reused."""
from __future__ import annotations

import torch
import torch.distributed as dist

from layer2_comm import launch
from layer2_comm import symmetric_group as sg


def _fresh_or_same(stale_rank: int) -> tuple[str, str, bool, float]:
    world = dist.group.WORLD
    sg._USED.clear()
    if dist.get_rank() == stale_rank:  # as if an earlier engine in this process had used "0"
        sg._USED[world.group_name] = object()
    group = sg.symmetric_group(world, torch.device("cpu"))
    again = sg.symmetric_group(group, torch.device("cpu"))  # now remembered: kept as is
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x, group=group)
    return world.group_name, group.group_name, again is group, float(x)


def _same() -> tuple[str, str]:
    sg._USED.clear()
    world = dist.group.WORLD
    return world.group_name, sg.symmetric_group(world, torch.device("cpu")).group_name


def test_a_name_seen_on_one_rank_moves_every_rank_to_a_new_group():
    for stale_rank in (0, 1):
        out = launch(_fresh_or_same, 3, stale_rank, backend="gloo", timeout_s=60)
        names = {new for _, new, _, _ in out}
        assert len(names) == 1, out  # every rank agrees on the new group
        assert all(new != old and kept for old, new, kept, _ in out), out
        assert all(total == 6.0 for *_, total in out), out  # the new group works: 1 + 2 + 3


def test_an_unseen_name_keeps_the_group():
    out = launch(_same, 2, backend="gloo", timeout_s=60)
    assert all(old == new for old, new in out), out
