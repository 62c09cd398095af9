"""Where each rank of a pipeline sits and the groups it talks on: its (stage, shard), its part
of the model, the process group of its stage's shards, the group the logits go back on, and
the check that every worker holds what its rank should (engine.py starts them)."""
from __future__ import annotations

import layer4_algorithms as engine

from ..runtime import TPComm, sub_group
from ..tensor_parallel.shard import shard_model, tp_config
from . import stage as S

l3 = engine.executor


def place(rank: int, tp: int) -> tuple[int, int]:
    """(stage, shard) of a rank: ranks 0..T-1 are stage 0, T..2T-1 stage 1, ..."""
    return divmod(rank, tp)


def stage_of(full, rank: int, stages: int, tp: int, comm: TPComm | None, device,
             expert_parallel: bool) -> S.StageNet:
    """Rank's stage of the whole model `full`: its shard first (tp > 1), then its layers."""
    s, t = place(rank, tp)
    # fuse_norms off: a stage's last block hands its output to the next stage, so its
    # row-parallel sums must be complete there
    net = full if tp == 1 else shard_model(full, t, tp, comm, device=device,
                                           expert_parallel=expert_parallel, fuse_norms=False)
    return S.StageNet(net, s, stages)


def tp_comm(store, rank: int, tp: int, backend: str, check: bool,
            timeout_s: float) -> TPComm | None:
    """The process group of rank's stage's shards (None when tp == 1)."""
    if tp == 1:
        return None
    s, t = place(rank, tp)
    return TPComm("torch", check=check, pg=sub_group(store, f"stage{s}", backend, t, tp,
                                                     timeout_s))


def logits_group(store, rank: int, world: int, backend: str, timeout_s: float):
    """A second group over every rank, for the logits the last stage sends back to rank 0
    (None under "ours", no store: they go over the one default group). Under NCCL the
    p2p of one pair of ranks in one group share one communicator and one stream, run in the
    order posted: with 2 stages rank 0 posts send x0, send x1, recv logits0 and rank 1
    recv x0, send logits0, recv x1, so rank 0's `send x1` and rank 1's `send logits0` wait on
    each other once both outgrow NCCL's buffers (a long micro-batch beside many sampled rows):
    a hang. The logits on a group of their own take another communicator and stream."""
    if store is None:
        return None
    return TPComm("torch", pg=sub_group(store, "logits", backend, rank, world, timeout_s))


def check_stages(info: list[tuple], config, stages: int, tp: int) -> None:
    """Every worker loaded the same model and holds the layers (and shard) its rank should."""
    layers = S.partition(config.num_hidden_layers, stages)
    for rank, (_, whole, local, _) in enumerate(info, start=1):
        s, t = place(rank, tp)
        if whole != config:
            raise ValueError(f"rank {rank} (stage {s}) loaded a different model ({whole}) than "
                             f"rank 0 ({config})")
        per_rank = config if tp == 1 else tp_config(config, tp, t)
        if local != S.stage_config(per_rank, layers[s]):
            raise ValueError(f"rank {rank} holds {local}, expected layers "
                             f"{layers[s].start}..{layers[s].stop - 1} of shard {t}")
