"""The runtime every multi-process form shares (tensor and pipeline parallelism, and both).

Rank 0 runs layer 4's engine; ranks 1..N-1 are worker processes that run only their part of
the model. group.py starts, watches and stops them (rank 0's side); worker.py is the one loop
every worker runs, over a *program* its form builds (a shard, a stage, a shard of a stage);
step.py is what crosses per step (a host message through shm_broadcast.py's shared-memory
ring, and one packed broadcast, or for a pipeline's later stages the block table in the
message); comm.py the collectives over each engine's own process
group; rank0.py what layer 4's engine holds on rank 0 (a model that announces each forward,
a cache whose block copies reach every rank, a runner whose waits are bounded).
"""
from .comm import TPComm, host_store, new_group, sub_group
from .group import WorkerGroup
from .rank0 import RankedKVCache, RankZeroModel, RankZeroRunner, wait_event
from .step import decode_message, host_context, pack_step, step_message, unpack_step
from .worker import Rank, load_full, weight_bytes

__all__ = ["TPComm", "new_group", "host_store", "sub_group", "WorkerGroup", "RankZeroModel",
           "RankedKVCache", "RankZeroRunner", "wait_event", "step_message", "pack_step",
           "unpack_step", "host_context", "decode_message", "Rank", "load_full",
           "weight_bytes"]
