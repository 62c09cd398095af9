"""The engine under pipeline parallelism: `LLM(model, pipeline_parallel_size=P)`.

The layers are cut into P stages, one process each (tp_group.TPGroup starts, joins and watches
them, as for tensor parallelism). Rank 0 is stage 0 *and* runs layer 4's `LLM` unchanged —
scheduler, block manager, prefix cache, sampling — over a model that is a thin wrapper
(`PPModel`); each stage holds its layers' weights and a paged KV cache of just those layers
(same number of blocks everywhere, so the one set of block tables serves every stage):

    runner.execute(step) -> PPModel.forward(ids, ctx, cache)
        1. control message to each stage (pipe): query/seq lengths, flags, micro-batch cuts
        2. broadcast ids | slot_mapping | block_tables                    (all stages)
        3. the step's tokens cut into m micro-batches (pp_stage.micro_batches; a long prefill
           chunk too, its later pieces reading the earlier ones' KV);
           rank 0 runs stage 0 on micro-batch 0, sends its stream on, runs micro-batch 1 while
           stage 1 runs micro-batch 0, ... ; the last stage sends each micro-batch's logits back
        4. logits (concatenated in sequence order) -> layer 4 samples on rank 0

A step ends with every micro-batch's logits back on rank 0 (the next step's tokens depend on
them), so each step pays the pipeline's fill and drain: with equal stages the idle share of
a step is (p - 1) / (m + p - 1). Copy-on-write block copies go to every stage (llm.py's
TPPagedKVCache forwards them).
"""
from __future__ import annotations

import time
from collections import deque

import torch

import layer4_algorithms as engine

from . import pp_stage as S
from .pp_worker import EVENTS, worker_main
from .rank0_model import RankZeroModel
from .tp_group import TPGroup
from .tp_worker import pack_step, step_message

l3 = engine.executor


class PPModel(RankZeroModel):
    """Rank 0's model: stage 0 here (`shard`), the other stages on the workers. LlamaModel's
    forward signature; config is stage 0's (its layer count sizes rank 0's KV cache).
    stats: forwards, their wall seconds, and seconds stage 0 computed inside them."""

    def __init__(self, shard: S.StageNet, group: TPGroup, micro_batches: int) -> None:
        super().__init__(shard, group)
        self.micro_batches = micro_batches
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
            group.send(step_message(ctx, cache is not None, last_only) + (cuts,))
            group.comm.broadcast(pack_step(input_ids, ctx))
            parts = S.micro_contexts(ctx.query_lens_host, ctx.seq_lens_host, ctx.slot_mapping,
                                     ctx.block_tables, cuts, dev)
            pg, timeout = getattr(group.comm, "pg", None), group.timeout_s
            sends, busy = [], 0.0
            for i, (t0, t1, mctx, _) in enumerate(parts):
                c0 = time.perf_counter()
                out = shard(input_ids[t0:t1], mctx, cache, last_only)
                c1 = time.perf_counter()
                busy += c1 - c0
                self.events.append(("F", i, c0, c1))
                sends += S.send(pg, out, 1, i)
            vocab, last, logits = shard.full_config.vocab_size, group.world - 1, []
            for i, (t0, t1, mctx, final) in enumerate(parts):
                rows = mctx.num_seqs if last_only else t1 - t0
                x = S.recv(pg, (rows, vocab), torch.float32, last, i, dev, timeout,
                           "rank 0 receiving logits")
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
        """Per stage since the last call: seconds computing vs the forwards' wall seconds, and
        the latest compute intervals ("events"; the workers' come over the pipe) and forward
        spans. Resets the counters."""
        with self.group.guard("collecting timings"):
            self.group.send(("timings",))
            workers = [(m[1], m[2]) for m in self.group.gather("timings")]
        st = self.stats
        rows = [{"stage": s, "busy_s": b, "events": ev, "wall_s": st["wall_s"],
                 "forwards": st["forwards"], "micro_batches": st["micro_batches"],
                 "spans": list(self.spans)}
                for s, (b, ev) in enumerate([(st["busy_s"], list(self.events)), *workers])]
        self.stats = dict.fromkeys(st, 0) | {"wall_s": 0.0, "busy_s": 0.0}
        self.events.clear()
        self.spans.clear()
        return rows


def start_pipeline(llm, model, config, speculator, faults: dict[int, str] | None) -> None:
    """Build `llm` (layer 5's LLM, __init__ under way) as a pipeline over
    config.pipeline_parallel_size stages: start the stage workers, keep stage 0 here, run
    layer 4's __init__ over PPModel, make every stage's KV cache."""
    stages = config.pipeline_parallel_size
    full = model if isinstance(model, l3.Model) else l3.load(
        model, backend=config.backend, dtype=config.dtype, device=config.device)
    S.check_pp_size(full.config, stages)
    net = full.net
    if isinstance(model, l3.Model):
        source = ("state", net.config, net.state_dict(), net.backend)
    else:
        source = ("path", str(model), net.backend, net.dtype)
    llm.pipeline_parallel_size = stages
    llm.tp_group = group = TPGroup.start(
        stages, source, device=net.device, comm_backend=config.tp_backend, check=config.tp_check,
        timeout_s=config.tp_timeout_s, threads=config.tp_threads, faults=faults,
        worker=worker_main, label="pipeline-parallel")
    try:
        shard = S.StageNet(net, 0, stages)
        with group.guard("checking the stages"):
            _check_stages(group, net.config, stages)
        micro = config.pp_micro_batches or stages
        wrapped = l3.Model(PPModel(shard, group, micro), full.tokenizer)
        del net, full
        engine.LLM.__init__(llm, wrapped, config, speculator=speculator)
        llm.worker_kv_bytes = group.make_caches(llm.cache)
    except BaseException:
        llm.close()
        raise


def _check_stages(group: TPGroup, config, stages: int) -> None:
    """Every worker loaded the same model and holds the layers its stage should."""
    layers = S.partition(config.num_hidden_layers, stages)
    for rank, (_, full, local, _) in enumerate(group.worker_info, start=1):
        if full != config:
            raise ValueError(f"stage {rank} loaded a different model ({full}) than rank 0 "
                             f"({config})")
        if local != S.stage_config(config, layers[rank]):
            raise ValueError(f"stage {rank} holds {local.num_hidden_layers} layers, expected "
                             f"layers {layers[rank].start}..{layers[rank].stop - 1}")
