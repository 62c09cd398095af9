"""The engine under tensor parallelism: rank 0's model and each worker's program.

    LLM("models/course-target", tensor_parallel_size=2)   # llm.py wires this in

Rank 0 (this process) runs layer 4's `LLM` unchanged — scheduler, block manager, sampling —
over a model that is a thin wrapper (TPModel) around rank 0's shard (shard.py):

    runner.execute(step) -> TPModel.forward(ids, ctx, cache)
        1. control message to the workers (shared-memory ring): query/seq lengths, flags
        2. broadcast ids | slot_mapping | block_tables           (all ranks)
        3. rank 0's shard forward; the workers run theirs at the same time, each over its own
           paged-KV head shard; the row-parallel all-reduces keep them in lock step
        4. logits (all-gathered inside the shard) -> layer 4 samples on rank 0

Every rank's cache has the same number of blocks: layer 4 sizes rank 0's from the per-rank
config (its kv heads), so the KV budget is per rank. The workers run runtime/worker.py's loop
over a `ShardProgram` (build_shard makes it inside each worker). With cuda_graph=True, decode
steps skip the wrapper: every rank replays its CUDA graph of its shard's step, collectives
inside, the inputs broadcast inside the graph (graphs.py); prefill and mixed steps run as
above.
"""
from __future__ import annotations

import os
import time

import torch

import layer4_algorithms as engine

from ..runtime import Rank, RankZeroModel, WorkerGroup, pack_step, step_message, unpack_step
from ..runtime.group import note
from .graphs import TPGraphRunner
from .shard import check_tp_size, shard_model, tp_config

l3 = engine.executor


class TPModel(RankZeroModel):
    """Rank 0's model: announces each forward to the workers, then runs its own shard.
    Same forward signature as layer 3's LlamaModel; config is rank 0's per-rank config."""

    def forward(self, input_ids: torch.Tensor, ctx, cache=None, *,
                last_only: bool = False) -> torch.Tensor:
        with self.group.guard("forward step"):
            self.group.send(step_message(ctx, cache is not None, last_only))
            self.group.comm.broadcast(pack_step(input_ids, ctx))
            return self.shard(input_ids, ctx, cache, last_only=last_only)


class ShardProgram:
    """A worker's part under tensor parallelism: its shard, run on every step rank 0 announces,
    and (cuda_graph) its decode graphs, replayed when rank 0 names a bucket."""

    def __init__(self, shard) -> None:
        self.module, self.graphs = shard, None

    def make_cache(self, num_blocks: int, block_size: int) -> engine.PagedKVCache:
        m = self.module
        return engine.PagedKVCache.for_model(m.config, num_blocks, block_size, dtype=m.dtype,
                                             device=m.device)

    def step(self, msg: tuple, me: Rank, cache, events, fault: str | None) -> float:
        ids, ctx = unpack_step(msg, me.comm, me.device)
        if fault == "shape":  # a worker whose row-parallel output has one row too many
            me.comm.all_reduce(torch.zeros(ids.shape[0] + 1, self.module.config.hidden_size,
                                           dtype=self.module.dtype, device=me.device))
        start = time.perf_counter()
        self.module(ids, ctx, cache, last_only=msg[5])
        end = time.perf_counter()
        events.append(("F", 0, start, end))
        return end - start


    def message(self, msg: tuple, me: Rank, conn, cache, fault: str | None) -> None:
        """("graphs", max_num_seqs, max_blocks): capture (CPU: prepare) the decode graphs ->
        ("graphs", buckets); ("graph", bucket): replay one, its inputs arriving inside it."""
        kind = msg[0]
        if kind == "graphs":
            self.graphs = TPGraphRunner(self.module, cache, msg[1], msg[2], me.comm,
                                        capture=me.device.type == "cuda")
            conn.send(("graphs", len(self.graphs.buckets)))
        elif kind == "graph":
            if fault == "graph-die":
                os._exit(3)
            if fault == "graph-hang":  # a worker stuck mid-step: rank 0 must not wait for ever
                time.sleep(3600)
            self.graphs.replay(msg[1])
        else:
            raise ValueError(f"unknown message {kind!r} from rank 0")


def capture_graphs(group: WorkerGroup, net: TPModel, cache, config) -> TPGraphRunner:
    """Rank 0's decode graphs over its shard; every worker captures its own at the same time
    (the capture runs the collectives)."""
    max_blocks = -(-config.resolved_max_model_len // cache.block_size)
    n, on_gpu = config.max_num_seqs, net.device.type == "cuda"
    with group.guard("capturing the decode CUDA graphs"):
        group.send(("graphs", n, max_blocks))
        graph = TPGraphRunner(net.shard, cache, n, max_blocks, group.comm, group=group,
                              capture=on_gpu)
        group.gather("graphs", start_up=True)
    note(f"decode graphs {'captured' if on_gpu else 'prepared'} on every rank "
         f"(buckets {graph.buckets})")
    return graph


def build_shard(full, me: Rank, *, expert_parallel: bool = False) -> ShardProgram:
    """In a worker: its shard of the whole model `full` (the group's ranks all hold one)."""
    return ShardProgram(shard_model(full, me.rank, me.world, me.comm, device=me.device,
                                    expert_parallel=expert_parallel))


def start_tensor_parallel(full: l3.Model, source: tuple, config,
                          faults: dict[int, str] | None) -> tuple[WorkerGroup, l3.Model]:
    """Start config.tensor_parallel_size ranks over the loaded model `full`: the workers shard
    it (from `source`: a path to load, or the state rank 0 shares) while rank 0 shards its
    own. Returns the group and the Model layer 4's engine runs (TPModel, rank 0's tokenizer)."""
    tp, ep = config.tensor_parallel_size, config.enable_expert_parallel
    check_tp_size(full.config, tp)
    net = full.net
    group = WorkerGroup.start(
        tp, source, device=net.device, comm_backend=config.tp_backend, check=config.tp_check,
        timeout_s=config.tp_timeout_s, start_timeout_s=config.start_timeout_s,
        threads=config.tp_threads, faults=faults,
        build=build_shard, options={"expert_parallel": ep}, label="tensor-parallel")
    try:
        shard = shard_model(net, 0, tp, group.comm, expert_parallel=ep)
        info = group.wait_ready()
        with group.guard("checking the shards"):
            for rank, (_, whole, local, _) in enumerate(info, start=1):
                if whole != net.config:
                    raise ValueError(f"rank {rank} loaded a different model ({whole}) than "
                                     f"rank 0 ({net.config})")
                if local != tp_config(net.config, tp, rank):
                    raise ValueError(f"rank {rank} holds shard {local}, expected "
                                     f"{tp_config(net.config, tp, rank)}")
        return group, l3.Model(TPModel(shard, group), full.tokenizer)
    except BaseException:
        group.shutdown(graceful=False)
        raise
