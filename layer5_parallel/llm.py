"""The engine under tensor parallelism: `LLM(model, tensor_parallel_size=N, **engine_kwargs)`.

    with LLM("models/course-target", tensor_parallel_size=2, dtype="float32") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=32))

tensor_parallel_size=1 is layer 4's engine itself: no process, no wrapper, not one extra
instruction per step. For N > 1 rank 0 (this process) runs layer 4's `LLM` unchanged —
scheduler, block manager, sampling — over a model that is a thin wrapper:

    runner.execute(step) -> wrapper.forward(ids, ctx, cache)
        1. control message to the workers (shared-memory ring): query/seq lengths, flags
        2. broadcast ids | slot_mapping | block_tables           (all ranks)
        3. rank 0's shard forward; the workers run theirs at the same time, each over its own
           paged-KV head shard; the row-parallel all-reduces keep them in lock step
        4. logits (all-gathered inside the shard) -> layer 4 samples on rank 0

With cuda_graph=True, decode steps skip the wrapper: every rank replays its CUDA graph of
its shard's step, collectives inside, the inputs broadcast inside the graph (tp_graph.py);
prefill and mixed steps run as above. Copy-on-write block copies go to every rank too (the
cache wrapper below forwards them).
Every rank's cache has the same number of blocks: layer 4 sizes rank 0's from the per-rank
config (its kv heads), so the KV budget is per rank.
"""
from __future__ import annotations

import atexit
import itertools
import weakref
from dataclasses import replace
from pathlib import Path

import torch

import layer4_algorithms as engine

from .engine_config import EngineConfig
from .ep_model import MoEModelConfig, check_expert_parallel
from .external_launcher import shared_generator, start_launched
from .pp_engine import start_pipeline
from .rank0_model import RankZeroModel
from .tp import check_tp_size, shard_model, tp_config, weight_bytes
from .tp_graph import TPGraphRunner, TPModelRunner, wait_event
from .tp_group import TPGroup
from .tp_worker import pack_step, step_message

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


class TPPagedKVCache(engine.PagedKVCache):
    """Rank 0's paged cache (the tensors layer 4 made), whose copy-on-write copies happen on
    every rank."""

    def __init__(self, inner: engine.PagedKVCache, group: TPGroup) -> None:
        self.__dict__.update(inner.__dict__)
        self.group = group

    def context(self, *args, **kw):
        """Layer 4's step context; a closed group says so first (before layer 4 checks the step
        a failed one left behind)."""
        if self.group.error is not None:
            raise RuntimeError(f"the {self.group.label} group is closed: {self.group.error}")
        return super().context(*args, **kw)

    def copy_blocks(self, pairs) -> None:
        if pairs:
            with self.group.guard("copy-on-write"):
                self.group.send(("copy", [(int(s), int(d)) for s, d in pairs]))
        super().copy_blocks(pairs)


class LLM(engine.LLM):
    """Layer 4's engine over `config.tensor_parallel_size` ranks (see engine_config.py for the
    tp_* knobs). LLM(model, config=None, **overrides), as layer 4's."""

    def __init__(self, model: str | Path | l3.Model, config: engine.EngineConfig | None = None, *,
                 speculator=None, _tp_faults: dict[int, str] | None = None, **overrides) -> None:
        config = EngineConfig.of(config)
        config = replace(config, **overrides) if overrides else config  # validates
        tp = config.tensor_parallel_size
        self.tensor_parallel_size, self.tp_group, self.launched = tp, None, None
        if config.enable_expert_parallel:
            check_expert_parallel(model, tp)
        if config.cuda_graph and isinstance(getattr(getattr(model, "net", None), "config", None),
                                            MoEModelConfig):  # routing reads counts on the host
            raise ValueError("cuda_graph=True cannot capture an MoE model (its routing syncs "
                             "with the host every layer); use cuda_graph=False")
        if config.pipeline_parallel_size > 1:  # layers cut into stages: pp_engine.py
            start_pipeline(self, model, config, speculator, _tp_faults)
            atexit.register(_close_ref, weakref.ref(self))
            return
        if config.distributed_executor_backend == "external_launcher":  # every rank: torchrun
            self._launch_seeds = itertools.count()
            start_launched(self, model, config, speculator)
            atexit.register(_close_ref, weakref.ref(self))
            return
        if tp == 1:  # layer 4's engine, untouched
            super().__init__(model, config, speculator=speculator)
            return
        full = model if isinstance(model, l3.Model) else l3.load(
            model, backend=config.backend, dtype=config.dtype, device=config.device)
        check_tp_size(full.config, tp)
        net = full.net
        if isinstance(model, l3.Model):
            source = ("state", net.config, net.state_dict(), net.backend)
        else:
            source = ("path", str(model), net.backend, net.dtype)
        self.tp_group = group = TPGroup.start(
            tp, source, device=net.device, comm_backend=config.tp_backend, check=config.tp_check,
            timeout_s=config.tp_timeout_s, threads=config.tp_threads, faults=_tp_faults,
            expert_parallel=config.enable_expert_parallel)
        try:
            shard = shard_model(net, 0, tp, group.comm,
                                expert_parallel=config.enable_expert_parallel)
            with group.guard("checking the shards"):
                _check_workers(group, net.config, tp)
            del net
            wrapped = l3.Model(TPModel(shard, group), full.tokenizer)
            del full
            super().__init__(wrapped, config, speculator=speculator)
        except BaseException:
            self.close()
            raise
        atexit.register(_close_ref, weakref.ref(self))

    def make_runner(self) -> engine.ModelRunner:
        """Layer 4's runner (TP: the workers make their caches first; with cuda_graph every
        rank captures its decode graphs, the workers at the same time as rank 0)."""
        group = self.tp_group
        if group is None:
            return super().make_runner()
        self.worker_kv_bytes = group.make_caches(self.cache)
        runner = TPModelRunner(self.model.net, self.cache, replace(self.config, cuda_graph=False))
        runner.group = group
        if self.config.cuda_graph:
            max_blocks = -(-self.config.resolved_max_model_len // self.cache.block_size)
            n, on_gpu = self.config.max_num_seqs, self.model.net.device.type == "cuda"
            with group.guard("capturing the decode CUDA graphs"):
                group.send(("graphs", n, max_blocks))
                runner.graph = TPGraphRunner(self.model.net.shard, self.cache, n, max_blocks,
                                             group.comm, group=group, capture=on_gpu)
                group.gather("graphs")
        return runner

    def _complete(self, launched, advanced, finished) -> None:
        """Layer 4's; the wait for a step's tokens is bounded by the group's timeout."""
        if self.tp_group is not None and launched.event is not None:
            wait_event(self.tp_group, launched.event, "reading a step's tokens")
        super()._complete(launched, advanced, finished)

    def _generator(self, params, index: int) -> torch.Generator:
        """Layer 4's; under external_launcher every rank draws the same stream."""
        if self.launched is not None:
            return shared_generator(self.launched, params, index, self._launch_seeds)
        return super()._generator(params, index)

    def make_cache(self) -> engine.PagedKVCache:
        """Layer 4's cache (sized by the per-rank config), copy-on-write forwarded to the ranks."""
        cache = super().make_cache()
        return cache if self.tp_group is None else TPPagedKVCache(cache, self.tp_group)

    # ---- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers and leave the process group (a no-op at tp=1 or when closed)."""
        group, self.tp_group = getattr(self, "tp_group", None), None
        if group is not None:
            group.shutdown()
        launched = getattr(self, "launched", None)
        if launched is not None:
            launched.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- what each rank holds ------------------------------------------------------------------
    def rank_memory(self) -> list[dict[str, int]]:
        """Per rank: weight and KV-cache bytes ({"rank", "weights", "kv"})."""
        shard = self.runner.net.shard if self.tp_group else self.runner.net
        rows = [{"rank": 0, "weights": weight_bytes(shard), "kv": self.cache.nbytes}]
        if self.tp_group is not None:
            for r, (info, kv) in enumerate(zip(self.tp_group.worker_info, self.worker_kv_bytes,
                                               strict=True), start=1):
                rows.append({"rank": r, "weights": info[3], "kv": kv})
        return rows

    @torch.no_grad()
    def prompt_logits(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        """fp32 logits (L_i, V) of every position of each token list, one prefill with no cache
        (through every rank under TP): for comparing TP against one process."""
        net = self.runner.net
        lens = [len(t) for t in token_ids]
        flat = [t for seq in token_ids for t in seq]
        ids = torch.tensor(flat, dtype=torch.int64, device=net.device)
        slots = torch.zeros(len(flat), dtype=torch.int64)  # no cache: nothing is written
        ctx = l3.AttentionContext.build(lens, [0] * len(lens), slots, device=net.device)
        return list(net(ids, ctx, None).split(lens))


def _check_workers(group: TPGroup, config, tp: int) -> None:
    """Every worker loaded the same model and holds the shard its rank should."""
    for rank, (_, full, local, _) in enumerate(group.worker_info, start=1):
        if full != config:
            raise ValueError(f"rank {rank} loaded a different model ({full}) than rank 0 "
                             f"({config})")
        if local != tp_config(config, tp, rank):
            raise ValueError(f"rank {rank} holds shard {local}, expected "
                             f"{tp_config(config, tp, rank)}")


def _close_ref(ref: weakref.ref) -> None:
    llm = ref()
    if llm is not None:
        llm.close()
