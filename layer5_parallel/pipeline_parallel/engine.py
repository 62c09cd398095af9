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
        1. control message to the workers (shared-memory ring): query/seq lengths, flags,
           micro-batch cuts, and with one rank a stage the block table
        2. with T > 1: broadcast ids | slot_mapping | block_tables        (all ranks)
           (one rank a stage: nothing; each later stage builds its context from the table)
        3. the step's tokens cut into m micro-batches (stage.micro_batches; a long prefill
           chunk too, its later pieces reading the earlier ones' KV); every rank runs
           `run_stage`: for each micro-batch, its input (stage 0: the ids; else the stream from
           the same shard of stage s-1), its layers, its output to the same shard of stage s+1
           — so stage 0 runs micro-batch 1 while stage 1 runs micro-batch 0, ...; shard 0 of
           the last stage sends each micro-batch's logits back to rank 0
        4. logits (concatenated in sequence order) -> layer 4 samples on rank 0

A step ends with every micro-batch's logits back on rank 0 (the next step's tokens depend on
them), so each step pays the pipeline's fill and drain: with equal stages the idle share of
a step is (p - 1) / (m + p - 1) — unless several steps are in flight, each over its own group
of sequences (in_flight.py: forward then returns after dispatch, the logits collected later).
The workers run runtime/worker.py's loop over a `StageProgram` (build_stage makes it inside
each worker); ranks.py says which rank holds what.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

import layer4_algorithms as engine

from ..runtime import (
    Rank,
    RankZeroModel,
    WorkerGroup,
    decode_message,
    host_context,
    pack_step,
    step_message,
    unpack_step,
)
from ..runtime.worker import EVENTS
from ..tensor_parallel.shard import check_tp_size
from . import stage as S
from .graphs import StageGraphRunner
from .ranks import check_stages, logits_group, place, stage_of, tp_comm

l3 = engine.executor


def run_stage(stage: S.StageNet, pg, rank: int, tp: int, input_ids: torch.Tensor | None,
              parts: list, cache, last_only: bool, timeout_s: float, events,
              fault: str | None = None, checked: bool = True,
              back=None, graphs=None, greedy: bool = False) -> tuple[list, float]:
    """This rank's share of one step: every micro-batch in, through its layers, out (rank 0
    and the workers alike). Returns the sends still in flight and the seconds computed;
    appends ("F", i, start, end) per micro-batch to events. checked: hand-offs carry a
    checked header (stage.headers_on). back: the group the logits go back to rank 0 on
    (logits_group; None: pg). graphs: this rank's StageGraphRunner (cuda_graph): decode
    micro-batches replay its graphs. greedy: the last stage sends back each row's argmax
    (int64 token ids) instead of its logits (greedy_ids says when)."""
    s, t = place(rank, tp)
    hidden = stage.full_config.hidden_size
    ids_back = greedy and stage.last
    sends, busy = [], 0.0
    for i, (t0, t1, mctx, _) in enumerate(parts):
        if stage.first:
            inp = input_ids[t0:t1]
        else:
            inp = S.recv(pg, (2, t1 - t0, hidden), stage.dtype, rank - tp, i, stage.device,
                         timeout_s, f"stage {s} receiving", checked=checked)
        start = time.perf_counter()
        if graphs is not None and graphs.applies(mctx, cache):
            # ids back: the argmax reads the graph's output buffer before the next replay
            # (stream order), so the logits need no copy
            out = graphs.run_micro(inp, mctx, copy=not ids_back)
        else:
            out = stage(inp, mctx, cache, last_only)
        if fault == "shape":  # a stage whose output has one row too many
            out = torch.cat((out, out.narrow(-2, 0, 1)), dim=-2)
        if ids_back:  # each row's first maximum: the token layer 4 would sample
            out = engine.greedy_tokens(out)
        end = time.perf_counter()
        busy += end - start
        events.append(("F", i, start, end))
        if not stage.last:
            sends += S.send(pg, out, rank + tp, i, checked=checked)
        elif t == 0:  # the last stage's shards all hold the logits: one sends them
            sends += S.send(pg if back is None else back, out, 0, i, checked=checked)
    return sends, busy


@dataclass
class PendingLogits:
    """A dispatched step whose logits rank 0 has not received yet: its micro-batches (first
    token, end token, context, the rows a last_only step keeps), the logits rows each
    contributes, its own sends still in flight, and (deferred) the buffer collect fills.
    greedy: the last stage sends each row's argmax (int64) instead of its logits."""

    parts: list
    rows: list[int]
    last_only: bool
    checked: bool
    sends: list
    start: float
    greedy: bool = False
    out: torch.Tensor | None = None
    ready: object = None  # (GPU) the event after which `out` may be written on any stream


class PPModel(RankZeroModel):
    """Rank 0's model: stage 0 (its shard) here, the other ranks in the workers. LlamaModel's
    forward signature; config is rank 0's part's (its layer count sizes rank 0's KV cache).
    A forward is `dispatch` (the step to every rank, stage 0's micro-batches computed and sent
    on) then `collect` (the logits back from the last stage); with `deferred` set, forward
    returns after dispatch, the logits buffer still to be filled, and leaves the step in
    `pending` for a later collect (steps in flight: in_flight.py). Steps are collected in the
    order dispatched (hand-offs between two ranks are matched in the order posted).
    With `greedy` set (PPRunner sets it for a step of greedy rows only: greedy_ids) the last
    stage sends back token ids and forward returns them, (rows,) int64, for "logits".
    stats: forwards, their wall seconds, and seconds rank 0 computed inside them."""

    def __init__(self, shard: S.StageNet, group: WorkerGroup, micro_batches: int,
                 tp: int = 1, back=None) -> None:
        super().__init__(shard, group)
        self.micro_batches, self.tp, self.back = micro_batches, tp, back
        self.graphs: StageGraphRunner | None = None  # capture_stage_graphs
        self.deferred = False  # forward returns after dispatch (in_flight.py)
        self.greedy = False  # the last stage sends back greedy token ids (greedy_ids)
        self.pending: list[PendingLogits] = []  # deferred steps not yet handed to collect
        self.stats = {"forwards": 0, "micro_batches": 0, "wall_s": 0.0, "busy_s": 0.0}
        self.events: deque = deque(maxlen=EVENTS)  # ("F", micro-batch, start, end), latest
        self.spans: deque = deque(maxlen=EVENTS)  # (start, end) of each forward, latest

    def forward(self, input_ids: torch.Tensor, ctx, cache=None, *,
                last_only: bool = False) -> torch.Tensor:
        step = self.dispatch(input_ids, ctx, cache, last_only)
        if not self.deferred:
            return self.collect(step)
        self.pending.append(step)
        return step.out

    def dispatch(self, input_ids: torch.Tensor, ctx, cache, last_only: bool) -> PendingLogits:
        """The step to every rank and stage 0's share of it: returns it to collect."""
        group, shard, dev = self.group, self.shard, self.device
        with group.guard("pipeline step"):
            start = time.perf_counter()
            cuts = S.micro_batches(ctx.query_lens_host, self.micro_batches,
                                   split=cache is not None)
            greedy = self.greedy and cache is not None
            table = self._table_for_ring(ctx, cache)
            group.send(step_message(ctx, cache is not None, last_only, cuts, greedy, table))
            early = []
            if table is None:  # the stages take ids | slots | tables from one broadcast
                packed = pack_step(input_ids, ctx)
                if self.deferred:  # the later stages may be on earlier steps: not waited here
                    early = group.comm.broadcast_start(packed)
                else:
                    group.comm.broadcast(packed)
            parts = S.micro_contexts(ctx.query_lens_host, ctx.seq_lens_host, ctx.slot_mapping,
                                     ctx.block_tables, cuts, dev, whole=ctx)
            checked = S.headers_on(dev, group.comm.check)
            # last_only: a sequence cut across micro-batches samples from its last piece
            rows = [len(final) if last_only else t1 - t0 for t0, t1, _, final in parts]
            out, ready = self._deferred_buffer(sum(rows), greedy) if self.deferred else (None,
                                                                                         None)
            sends, busy = run_stage(shard, group.comm.pg, 0, self.tp, input_ids, parts, cache,
                                    last_only, group.timeout_s, self.events, checked=checked,
                                    back=self.back, graphs=self.graphs, greedy=greedy)
        st = self.stats
        st["forwards"] += 1
        st["micro_batches"] += len(cuts)
        st["busy_s"] += busy
        st["wall_s"] += time.perf_counter() - start
        return PendingLogits(parts, rows, last_only, checked, early + sends, start, greedy, out,
                             ready)

    @property
    def ops(self):
        """The kernels every stage runs (layer 3's Ops), as layer 4's runner asks for them
        (`pads_prefill_attention(net)`: whether a mixed step's attention pads, so that the
        step must be cut into passes under attn_bytes_limit): the shard's, judged against the
        whole model's config (a sliding window in another stage's layers pads there); None
        where some stage pads. Without it every mixed step counted as padded: with long
        prompts it was cut into several passes, and with steps in flight it drained the
        pipeline first, where the triton kernels pad nothing."""
        shard = self.shard
        whole = SimpleNamespace(ops=shard.ops, config=shard.full_config)
        return None if l3.pads_prefill_attention(whole) else shard.ops

    def decode_fits(self, B: int, n: int) -> bool:
        """Whether a decode step of B sequences with (B, n) block tables can go through
        `decode_host`: one rank a stage, one micro-batch, rank 0's stage graphs fit it, and
        its table fits the ring beside the lengths."""
        return (self.tp == 1 and self.micro_batches == 1 and self.graphs is not None
                and self.graphs.can_run(B, n)
                and 4 * B * (n + 6) <= self.group.ring.slot_bytes // 2)

    def decode_host(self, input_ids: torch.Tensor | np.ndarray, positions, table,
                    gather: np.ndarray | None = None) -> torch.Tensor:
        """forward() of a decode step from its host arrays (what layer 4's runner hands a
        CUDA graph: positions (B,) and block table (B, n), int64 numpy, each row long enough
        for its position: the runner checked): the table goes to the stages in the step's
        message, and rank 0's stage replays its graph from the arrays (run_micro_host)
        without an AttentionContext; input_ids as layer 4's run_host takes them (on the
        device, on the host, or gathered). decode_fits says when. Returns what forward
        returns: the logits, or the token ids of a greedy step."""
        step = self._dispatch_decode(input_ids, positions, table, gather)
        if not self.deferred:
            return self.collect(step)
        self.pending.append(step)
        return step.out

    def _dispatch_decode(self, input_ids, positions, table, gather=None) -> PendingLogits:
        group, (B, n) = self.group, table.shape
        with group.guard("pipeline step"):
            start = time.perf_counter()
            greedy = self.greedy
            rows = (table.astype(np.int32), np.full(B, n, dtype=np.int32))  # (long enough)
            group.send(decode_message((positions + 1).tolist(), rows, greedy))
            checked = S.headers_on(self.device, group.comm.check)
            out, ready = self._deferred_buffer(B, greedy) if self.deferred else (None, None)
            t0 = time.perf_counter()
            x = self.graphs.run_micro_host(input_ids, positions, table, gather=gather)
            t1 = time.perf_counter()
            self.events.append(("F", 0, t0, t1))
            sends = S.send(group.comm.pg, x, 1, 0, checked=checked)
        st = self.stats
        st["forwards"] += 1
        st["micro_batches"] += 1
        st["busy_s"] += t1 - t0
        st["wall_s"] += time.perf_counter() - start
        # one micro-batch of B rows, one a sequence: collect needs no context
        return PendingLogits([(0, B, None, None)], [B], False, checked, sends, start, greedy,
                             out, ready)

    def _deferred_buffer(self, rows: int, greedy: bool):
        """The buffer a deferred step's logits (greedy: token ids) land in, made before the
        step's own work is queued, and on a GPU an event recorded right then: a collect on
        another stream (in_flight.py lands steps on a stream of their own) waits for that event
        only, which covers every earlier use of the buffer's memory on this stream, not for the
        stage's work queued after it."""
        if greedy:
            out = torch.empty(rows, dtype=torch.int64, device=self.device)
        else:
            out = torch.empty((rows, self.shard.full_config.vocab_size), dtype=torch.float32,
                              device=self.device)
        ready = None
        if out.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return out, ready

    def _table_for_ring(self, ctx, cache):
        """The step's block table for the message, (rows, lengths) int32, when the workers
        can build their contexts from it: one rank a stage (no worker takes the ids, which
        stay on rank 0's device) and a table the runner handed over that fits the ring
        beside the lengths. Then nothing is broadcast: no packing kernel, no collective on
        either side, and the workers need no device-side context from rank 0. Else None."""
        table = getattr(ctx, "host_table", None)
        if self.tp != 1 or cache is None or table is None:
            return None
        rows, lens = table
        if 4 * rows.size + 24 * len(lens) > self.group.ring.slot_bytes // 2:
            return None
        return rows.astype(np.int32), lens.astype(np.int32)

    def collect(self, step: PendingLogits) -> torch.Tensor:
        """A dispatched step's fp32 logits (greedy: its int64 token ids), micro-batch by
        micro-batch from the last stage (on GPUs the waits are stream-ordered), into step.out
        when dispatch left one."""
        group, dev, timeout = self.group, self.device, self.group.timeout_s
        begin = time.perf_counter()
        with group.guard("pipeline step"):
            vocab, last, logits = self.shard.full_config.vocab_size, group.world - self.tp, []
            back = group.comm.pg if self.back is None else self.back
            shape, dtype = ((), torch.int64) if step.greedy else ((vocab,), self.shard.dtype)
            what = "rank 0 receiving " + ("token ids" if step.greedy else "logits")
            if step.ready is not None:  # collected on another stream than dispatched
                stream = torch.cuda.current_stream(dev)
                stream.wait_event(step.ready)
                step.out.record_stream(stream)
            offset = 0
            for i, (t0, t1, mctx, final) in enumerate(step.parts):
                rows = mctx.num_seqs if step.last_only else t1 - t0
                whole = not step.last_only or len(final) == rows
                if step.greedy and step.out is not None and whole and len(step.parts) == 1:
                    S.recv(back, (rows,), dtype, last, i, dev, timeout, what,
                           checked=step.checked, out=step.out)  # (ids: straight in)
                    continue
                x = S.recv(back, (rows, *shape), dtype, last, i, dev, timeout, what,
                           checked=step.checked)
                x = x if whole else x[final]
                if step.out is None:
                    logits.append(x if step.greedy else x.float())
                else:  # widened straight into the buffer the engine holds (one pass)
                    step.out[offset:offset + len(x)].copy_(x)
                    offset += len(x)
            S.wait_sends(step.sends, timeout, "rank 0 sending")
        end = time.perf_counter()
        self.stats["wall_s"] += end - begin
        self.spans.append((step.start, end))
        if step.out is not None:
            return step.out
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
    back: the group its logits go back to rank 0 on (logits_group). in_flight: the steps rank
    0 keeps in flight; with more than one, the last stage leaves a step's logits sends
    unwaited until in_flight steps later (rank 0 receives a step's logits only when it
    collects it, just before it dispatches the step in_flight after it, and a send may not
    finish before its receive is posted: waiting earlier would idle this stage through the
    steps between)."""

    def __init__(self, stage: S.StageNet, tp: int, back=None, in_flight: int = 1) -> None:
        self.module, self.tp, self.back, self.in_flight = stage, tp, back, in_flight
        self.graphs: StageGraphRunner | None = None
        self.held: deque = deque()  # the logits sends of the last steps, not waited yet
        self.staging = l3.HostStaging(stage.device)  # pinned buffers: contexts from tables

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
        _, qlens, slens, _, _, last_only, cuts, greedy, table = msg
        while len(self.held) >= self.in_flight:  # rank 0 has collected those steps
            S.wait_sends(self.held.popleft(), me.timeout_s, f"rank {me.rank} sending logits")
        if table is not None:  # (a later stage: no ids; the context from the table)
            self.staging.next_step()
            ids, ctx = None, host_context(msg, cache, me.device, self.staging)
        else:
            ids, ctx = unpack_step(msg, me.comm, me.device)
        parts = S.micro_contexts(qlens, slens, ctx.slot_mapping, ctx.block_tables, cuts,
                                 me.device, whole=ctx)
        sends, busy = run_stage(self.module, me.comm.pg, me.rank, self.tp, ids, parts, cache,
                                last_only, me.timeout_s, events, fault,
                                checked=S.headers_on(me.device, me.comm.check), back=self.back,
                                graphs=self.graphs, greedy=greedy)
        if self.in_flight > 1 and self.module.last:
            self.held.append(sends)
        else:
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
        group.gather("stage_graphs", start_up=True)


def build_stage(full, me: Rank, *, stages: int, tp: int = 1, check: bool = False,
                expert_parallel: bool = False, in_flight: int = 1) -> StageProgram:
    """In a worker: its stage (its shard of it under tp > 1) of the whole model `full`;
    in_flight: pp_steps_in_flight."""
    backend = "nccl" if me.device.type == "cuda" else "gloo"
    comm = tp_comm(me.store, me.rank, tp, backend, check, me.start_timeout_s)
    back = logits_group(me.store, me.rank, me.world, backend, me.start_timeout_s)
    return StageProgram(stage_of(full, me.rank, stages, tp, comm, me.device, expert_parallel),
                        tp, None if back is None else back.pg, in_flight)


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
        check=config.tp_check, timeout_s=config.tp_timeout_s,
        start_timeout_s=config.start_timeout_s, threads=config.tp_threads,
        faults=faults, build=build_stage,
        options={"stages": stages, "tp": tp, "check": config.tp_check, "expert_parallel": ep,
                 "in_flight": config.pp_steps_in_flight},
        label=label)
    try:
        with group.guard("building stage 0"):
            start_s = group.start_timeout_s
            comm = tp_comm(group.store, 0, tp, group.backend, config.tp_check, start_s)
            back = logits_group(group.store, 0, group.world, group.backend, start_s)
            if back is not None:
                group.extra_comms.append(back)  # aborted with the group's own (shutdown)
            if comm is not None:
                group.stage_comms.append(comm)  # the step limit once every rank is up
            shard = stage_of(net, 0, stages, tp, comm, net.device, ep)
        info = group.wait_ready()
        with group.guard("checking the stages"):
            check_stages(info, net.config, stages, tp)
        # steps in flight: each is one group's micro-batch (the groups keep the stages busy)
        micro = config.pp_micro_batches or (1 if config.pp_steps_in_flight > 1 else stages)
        return group, l3.Model(PPModel(shard, group, micro, tp, None if back is None else back.pg),
                               full.tokenizer)
    except BaseException:
        group.shutdown(graceful=False)
        raise
