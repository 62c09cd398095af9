"""The engine under pipeline parallelism, alone or with tensor parallelism inside each stage.

    LLM(model, pipeline_parallel_size=P)                           # P stages, one rank each
    LLM(model, pipeline_parallel_size=P, tensor_parallel_size=T)   # P stages of T ranks each

The layers are cut into P stages (stage.py); with T > 1 each stage's layers are also split
over T ranks Megatron-style (tensor_parallel/shard.py), the T ranks of a stage running their
all-reduces in a process group of their own. Rank r is stage r // T, shard r % T; rank 0 is
stage 0's shard 0 *and* runs layer 4's `LLM` unchanged — scheduler, block manager, prefix
cache, sampling — over a model that is a thin wrapper (`PPModel`). Every rank holds its
layers' weights (its shard of them) and a paged KV cache of just those layers (same number of
blocks everywhere, so the one set of block tables serves every rank):

    runner.execute(step) -> PPModel.forward(ids, ctx, cache)
        1. control message to each worker (pipe): query/seq lengths, flags, micro-batch cuts
        2. broadcast ids | slot_mapping | block_tables                    (all ranks)
        3. the step's tokens cut into m micro-batches (stage.micro_batches; a long prefill
           chunk too, its later pieces reading the earlier ones' KV); every rank runs
           `run_stage`: for each micro-batch, its input (stage 0: the ids; else the stream from
           the same shard of stage s-1), its layers, its output to the same shard of stage s+1
           — so stage 0 runs micro-batch 1 while stage 1 runs micro-batch 0, ...; shard 0 of
           the last stage sends each micro-batch's logits back to rank 0
        4. logits (concatenated in sequence order) -> layer 4 samples on rank 0

A step ends with every micro-batch's logits back on rank 0 (the next step's tokens depend on
them), so each step pays the pipeline's fill and drain: with equal stages the idle share of
a step is (p - 1) / (m + p - 1). The workers run runtime/worker.py's loop over a
`StageProgram` (build_stage makes it inside each worker).
"""
from __future__ import annotations

import time
from collections import deque

import torch

import layer4_algorithms as engine

from ..runtime import (
    Rank,
    RankZeroModel,
    TPComm,
    WorkerGroup,
    pack_step,
    step_message,
    sub_group,
    unpack_step,
)
from ..runtime.worker import EVENTS
from ..tensor_parallel.shard import check_tp_size, shard_model, tp_config
from . import stage as S
from .graphs import StageGraphRunner

l3 = engine.executor


def place(rank: int, tp: int) -> tuple[int, int]:
    """(stage, shard) of a rank: ranks 0..T-1 are stage 0, T..2T-1 stage 1, ..."""
    return divmod(rank, tp)


def run_stage(stage: S.StageNet, pg, rank: int, tp: int, input_ids: torch.Tensor | None,
              parts: list, cache, last_only: bool, timeout_s: float, events,
              fault: str | None = None, checked: bool = True,
              back=None, graphs=None) -> tuple[list, float]:
    """This rank's share of one step: every micro-batch in, through its layers, out (rank 0
    and the workers alike). Returns the sends still in flight and the seconds computed;
    appends ("F", i, start, end) per micro-batch to events. checked: hand-offs carry a
    checked header (stage.headers_on). back: the group the logits go back to rank 0 on
    (logits_group; None: pg). graphs: this rank's StageGraphRunner (cuda_graph): decode
    micro-batches replay its graphs."""
    s, t = place(rank, tp)
    hidden = stage.full_config.hidden_size
    sends, busy = [], 0.0
    for i, (t0, t1, mctx, _) in enumerate(parts):
        if stage.first:
            inp = input_ids[t0:t1]
        else:
            inp = S.recv(pg, (2, t1 - t0, hidden), stage.dtype, rank - tp, i, stage.device,
                         timeout_s, f"stage {s} receiving", checked=checked)
        start = time.perf_counter()
        if graphs is not None and graphs.applies(mctx, cache):
            out = graphs.run_micro(inp, mctx)
        else:
            out = stage(inp, mctx, cache, last_only)
        end = time.perf_counter()
        busy += end - start
        events.append(("F", i, start, end))
        if fault == "shape":  # a stage whose output has one row too many
            out = torch.cat((out, out.narrow(-2, 0, 1)), dim=-2)
        if not stage.last:
            sends += S.send(pg, out, rank + tp, i, checked=checked)
        elif t == 0:  # the last stage's shards all hold the logits: one sends them
            sends += S.send(pg if back is None else back, out, 0, i, checked=checked)
    return sends, busy


class PPModel(RankZeroModel):
    """Rank 0's model: stage 0 (its shard) here, the other ranks in the workers. LlamaModel's
    forward signature; config is rank 0's part's (its layer count sizes rank 0's KV cache).
    stats: forwards, their wall seconds, and seconds rank 0 computed inside them."""

    def __init__(self, shard: S.StageNet, group: WorkerGroup, micro_batches: int,
                 tp: int = 1, back=None) -> None:
        super().__init__(shard, group)
        self.micro_batches, self.tp, self.back = micro_batches, tp, back
        self.graphs: StageGraphRunner | None = None  # capture_stage_graphs
        self.stats = {"forwards": 0, "micro_batches": 0, "wall_s": 0.0, "busy_s": 0.0}
        self.events: deque = deque(maxlen=EVENTS)  # ("F", micro-batch, start, end), latest
        self.spans: deque = deque(maxlen=EVENTS)  # (start, end) of each forward, latest

    def forward(self, input_ids: torch.Tensor, ctx, cache=None, *,
                last_only: bool = False) -> torch.Tensor:
        group, shard, dev = self.group, self.shard, self.device
        with group.guard("pipeline step"):
            start = time.perf_counter()
            cuts = S.micro_batches(ctx.query_lens_host, self.micro_batches,
                                   split=cache is not None)
            group.send(step_message(ctx, cache is not None, last_only, cuts))
            group.comm.broadcast(pack_step(input_ids, ctx))
            parts = S.micro_contexts(ctx.query_lens_host, ctx.seq_lens_host, ctx.slot_mapping,
                                     ctx.block_tables, cuts, dev)
            pg, timeout = group.comm.pg, group.timeout_s
            checked = S.headers_on(dev, group.comm.check)
            sends, busy = run_stage(shard, pg, 0, self.tp, input_ids, parts, cache, last_only,
                                    timeout, self.events, checked=checked, back=self.back,
                                    graphs=self.graphs)
            vocab, last, logits = shard.full_config.vocab_size, group.world - self.tp, []
            back = pg if self.back is None else self.back
            for i, (t0, t1, mctx, final) in enumerate(parts):
                rows = mctx.num_seqs if last_only else t1 - t0
                x = S.recv(back, (rows, vocab), shard.dtype, last, i, dev, timeout,
                           "rank 0 receiving logits", checked=checked).float()
                # last_only: a sequence cut across micro-batches samples from its last piece
                logits.append(x if not last_only or len(final) == rows else x[final])
            S.wait_sends(sends, timeout, "rank 0 sending")
        st = self.stats
        st["forwards"] += 1
        st["micro_batches"] += len(cuts)
        end = time.perf_counter()
        st["wall_s"] += end - start
        self.spans.append((start, end))
        st["busy_s"] += busy
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def stage_busy(self) -> list[dict]:
        """Per rank since the last call: seconds computing vs the forwards' wall seconds, and
        the latest compute intervals ("events"; the workers' come over the pipe) and forward
        spans. Row r is rank r (its "stage": r // tp). Resets the counters."""
        with self.group.guard("collecting timings"):
            self.group.send(("timings",))
            workers = [(m[1], m[2]) for m in self.group.gather("timings")]
        st = self.stats
        rows = [{"stage": r // self.tp, "rank": r, "busy_s": b, "events": ev,
                 "wall_s": st["wall_s"], "forwards": st["forwards"],
                 "micro_batches": st["micro_batches"], "spans": list(self.spans)}
                for r, (b, ev) in enumerate([(st["busy_s"], list(self.events)), *workers])]
        self.stats = dict.fromkeys(st, 0) | {"wall_s": 0.0, "busy_s": 0.0}
        self.events.clear()
        self.spans.clear()
        return rows


class StageProgram:
    """A worker's part of a pipeline: its stage (or its shard of it) and the stage's KV cache;
    back: the group its logits go back to rank 0 on (logits_group)."""

    def __init__(self, stage: S.StageNet, tp: int, back=None) -> None:
        self.module, self.tp, self.back = stage, tp, back
        self.graphs: StageGraphRunner | None = None

    def make_cache(self, num_blocks: int, block_size: int) -> S.StageKVCache:
        return S.StageKVCache.for_stage(self.module, num_blocks, block_size)

    def message(self, msg: tuple, me: Rank, conn, cache, fault: str | None) -> None:
        """("stage_graphs", max_rows, max_blocks): capture (CPU: prepare) this stage's decode
        graphs over its cache -> ("stage_graphs", buckets)."""
        if msg[0] != "stage_graphs":
            raise ValueError(f"unknown message {msg[0]!r} from rank 0")
        self.graphs = StageGraphRunner(self.module, cache, msg[1], msg[2],
                                       capture=me.device.type == "cuda")
        conn.send(("stage_graphs", len(self.graphs.buckets)))

    def step(self, msg: tuple, me: Rank, cache, events, fault: str | None) -> float:
        _, qlens, slens, _, _, last_only, cuts = msg
        ids, ctx = unpack_step(msg, me.comm, me.device)
        parts = S.micro_contexts(qlens, slens, ctx.slot_mapping, ctx.block_tables, cuts,
                                 me.device)
        sends, busy = run_stage(self.module, me.comm.pg, me.rank, self.tp, ids, parts, cache,
                                last_only, me.timeout_s, events, fault,
                                checked=S.headers_on(me.device, me.comm.check), back=self.back,
                                graphs=self.graphs)
        S.wait_sends(sends, me.timeout_s, f"rank {me.rank} sending")
        return busy


def capture_stage_graphs(group: WorkerGroup, net: PPModel, cache, config) -> None:
    """cuda_graph under pipeline parallelism: every rank captures its stage's decode graphs
    (on a CPU: prepares the same buffers) over its cache, the workers at the same time as
    rank 0 (the graphs hold no collective, so nobody waits for another's capture)."""
    max_blocks = -(-config.resolved_max_model_len // cache.block_size)
    n = config.max_num_seqs
    with group.guard("capturing the stages' decode CUDA graphs"):
        group.send(("stage_graphs", n, max_blocks))
        net.graphs = StageGraphRunner(net.shard, cache, n, max_blocks,
                                      capture=net.device.type == "cuda")
        group.gather("stage_graphs")


def _stage_of(full, rank: int, stages: int, tp: int, tp_comm: TPComm | None, device,
              expert_parallel: bool) -> S.StageNet:
    """Rank's stage of the whole model `full`: its shard first (tp > 1), then its layers."""
    s, t = place(rank, tp)
    net = full if tp == 1 else shard_model(full, t, tp, tp_comm, device=device,
                                           expert_parallel=expert_parallel)
    return S.StageNet(net, s, stages)


def _tp_comm(store, rank: int, tp: int, backend: str, check: bool,
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


def build_stage(full, me: Rank, *, stages: int, tp: int = 1, check: bool = False,
                expert_parallel: bool = False) -> StageProgram:
    """In a worker: its stage (its shard of it under tp > 1) of the whole model `full`."""
    backend = "nccl" if me.device.type == "cuda" else "gloo"
    comm = _tp_comm(me.store, me.rank, tp, backend, check, me.timeout_s)
    back = logits_group(me.store, me.rank, me.world, backend, me.timeout_s)
    return StageProgram(_stage_of(full, me.rank, stages, tp, comm, me.device, expert_parallel),
                        tp, None if back is None else back.pg)


def start_pipeline(full: l3.Model, source: tuple, config,
                   faults: dict[int, str] | None) -> tuple[WorkerGroup, l3.Model]:
    """Start pipeline_parallel_size x tensor_parallel_size ranks over the loaded model `full`
    (the workers rebuild it from `source`). Returns the group and the Model layer 4's engine
    runs (PPModel over rank 0's part, rank 0's tokenizer)."""
    stages, tp = config.pipeline_parallel_size, config.tensor_parallel_size
    ep = config.enable_expert_parallel
    S.check_pp_size(full.config, stages)
    if tp > 1:
        check_tp_size(full.config, tp)
    net = full.net
    label = "pipeline-parallel" if tp == 1 else "pipeline x tensor-parallel"
    group = WorkerGroup.start(
        stages * tp, source, device=net.device, comm_backend=config.tp_backend,
        check=config.tp_check, timeout_s=config.tp_timeout_s, threads=config.tp_threads,
        faults=faults, build=build_stage,
        options={"stages": stages, "tp": tp, "check": config.tp_check, "expert_parallel": ep},
        label=label)
    try:
        with group.guard("building stage 0"):
            comm = _tp_comm(group.store, 0, tp, group.backend, config.tp_check, group.timeout_s)
            back = logits_group(group.store, 0, group.world, group.backend, group.timeout_s)
            if back is not None:
                group.extra_comms.append(back)  # aborted with the group's own (shutdown)
            shard = _stage_of(net, 0, stages, tp, comm, net.device, ep)
        info = group.wait_ready()
        with group.guard("checking the stages"):
            _check_stages(info, net.config, stages, tp)
        micro = config.pp_micro_batches or stages
        return group, l3.Model(PPModel(shard, group, micro, tp, None if back is None else back.pg),
                               full.tokenizer)
    except BaseException:
        group.shutdown(graceful=False)
        raise


def _check_stages(info: list[tuple], config, stages: int, tp: int) -> None:
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
