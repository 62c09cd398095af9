"""What the peer all-reduce's GPU tests share: inputs whose sums are exact in every dtype (so
ours must equal NCCL's bits), NCCL's answer to compare with, and one check run on every GPU."""
from __future__ import annotations

import torch
import torch.distributed as dist

from layer2_comm import launch


def exact_ints(n: int, dtype, salt: int) -> torch.Tensor:
    """n small integers on this rank's GPU, different per rank and salt: exact in every dtype,
    and so are their sums over a few ranks."""
    g = torch.Generator().manual_seed(salt * 7919 + dist.get_rank() * 31 + n)
    return torch.randint(-8, 9, (n,), generator=g).to(dtype).cuda()


def nccl_sum(x: torch.Tensor) -> torch.Tensor:
    """NCCL's all-reduce of a copy of x: the answer ours must give."""
    y = x.clone()
    dist.all_reduce(y)
    return y


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def assert_every_rank_passes(checks, timeout_s: float) -> None:
    """Run `checks` (a module-level function returning what failed on its rank) on every GPU
    and fail with the first 30 problems, each named with its rank."""
    reports = launch(checks, visible_gpus(), backend="nccl", timeout_s=timeout_s)
    bad = [f"rank {r}: {b}" for r, rep in enumerate(reports) for b in rep]
    assert not bad, "\n".join(bad[:30])
