"""Layer 5's engine: layer 4's `LLM` over as many ranks as the config asks for.

    with LLM("models/course-target", tensor_parallel_size=2, dtype="float32") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=32))

    LLM(path)                                                  layer 4's engine itself
    LLM(path, tensor_parallel_size=T)                          tensor_parallel/engine.py
    LLM(path, pipeline_parallel_size=P[, tensor_parallel_size=T])  pipeline_parallel/engine.py
    LLM(path, pipeline_parallel_size=P, pp_steps_in_flight=P)  P steps in flight: in_flight.py
    LLM(path, data_parallel_size=D, ...)                       D replicas: data_parallel/replicas.py
    LLM(path, tensor_parallel_size=T,                          every rank started by torchrun:
        distributed_executor_backend="external_launcher")      tensor_parallel/external_launcher.py

At one rank nothing is added: no process, no wrapper, not one extra instruction per step. Over
several, the form's `start_*` is composed in: it starts the worker ranks (runtime/) and returns
the group and a finished layer-3 `Model` whose net runs rank 0's part and tells the workers
what to run; layer 4's engine is then built over that Model, as over any other, and its cache
is a `RankedKVCache` (copy-on-write copies reach every rank) and its runner a
`RankZeroRunner` (bounded waits; with cuda_graph under tensor parallelism, the decode graphs
every rank replays: tensor_parallel/graphs.py). Rank 0 schedules, samples and returns the
outputs; the workers only compute. Under the external launcher there is no rank 0 helper:
every rank runs the whole engine over its shard, in lock step.
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
from .expert_parallel.engine_model import MoEModelConfig, check_expert_parallel
from .pipeline_parallel.engine import capture_stage_graphs, start_pipeline
from .pipeline_parallel.in_flight import StepsInFlight
from .pipeline_parallel.runner import PPRunner, StageDecode
from .runtime import RankedKVCache, RankZeroModel, RankZeroRunner, WorkerGroup, wait_event
from .runtime.worker import weight_bytes
from .tensor_parallel.engine import capture_graphs, start_tensor_parallel
from .tensor_parallel.external_launcher import shared_generator, start_launched

l3 = engine.executor


class LLM(StepsInFlight, engine.LLM):
    """Layer 4's engine over `tensor_parallel_size` x `pipeline_parallel_size` ranks (see
    engine_config.py for the knobs). LLM(model, config=None, **overrides), as layer 4's.
    With data_parallel_size > 1 the call returns a `ReplicaSet` (data_parallel/replicas.py):
    that many whole engines, one per process, with the same offline API."""

    def __new__(cls, model=None, config: engine.EngineConfig | None = None, **overrides):
        dp = overrides.get("data_parallel_size", getattr(config, "data_parallel_size", 1))
        if cls is LLM and dp not in (None, 1):
            from .data_parallel.replicas import ReplicaSet  # the replicas start engines: lazy
            return ReplicaSet(model, config, **overrides)
        return super().__new__(cls)

    def __init__(self, model: str | Path | l3.Model, config: engine.EngineConfig | None = None, *,
                 speculator=None, _tp_faults: dict[int, str] | None = None, **overrides) -> None:
        config = EngineConfig.of(config)
        config = replace(config, **overrides) if overrides else config  # validates
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.tensor_parallel_size, self.pipeline_parallel_size = tp, pp
        self.tp_group: WorkerGroup | None = None  # the worker ranks (None: one process)
        self.launched = None  # external_launcher: this rank's place among torchrun's ranks
        self.worker_kv_bytes: list[int] = []
        if config.enable_expert_parallel:
            check_expert_parallel(model, tp)
        if config.cuda_graph and isinstance(getattr(getattr(model, "net", None), "config", None),
                                            MoEModelConfig):  # routing reads counts on the host
            raise ValueError("cuda_graph=True cannot capture an MoE model (its routing syncs "
                             "with the host every layer); use cuda_graph=False")
        if config.distributed_executor_backend == "external_launcher":  # every rank: torchrun
            self.launched, wrapped, config = start_launched(model, config)
            self._launch_seeds = itertools.count()
            self._start_engine(wrapped, config, speculator)
            return
        if tp * pp == 1:  # layer 4's engine, untouched
            super().__init__(model, config, speculator=speculator)
            return
        full = model if isinstance(model, l3.Model) else l3.load(
            model, backend=config.backend, dtype=config.dtype, device=config.device)
        net = full.net
        if getattr(net, "worker_source", None) is not None:  # random weights: each rank draws
            source = net.worker_source                         # them (runtime/random_source.py)
        elif isinstance(model, l3.Model):  # the workers rebuild it from rank 0's shared tensors
            source = ("state", net.config, net.state_dict(), net.backend, type(net))
        else:  # or load it themselves
            source = ("path", str(model), net.backend, net.dtype)
        start = start_pipeline if pp > 1 else start_tensor_parallel
        self.tp_group, wrapped = start(full, source, config, _tp_faults)
        del full, net, source
        self._start_engine(wrapped, config, speculator)
        if config.pp_steps_in_flight > 1:  # the lanes' scheduler and step loop: in_flight.py
            self.start_lanes(config.pp_steps_in_flight)

    def _start_engine(self, wrapped, config: EngineConfig, speculator) -> None:
        """Layer 4's engine over the wrapped model; the ranks are stopped if it fails to start,
        and at interpreter exit if nobody closed it."""
        try:
            super().__init__(wrapped, config, speculator=speculator)
        except BaseException:
            self.close()
            raise
        atexit.register(_close_ref, weakref.ref(self))

    def make_cache(self) -> engine.PagedKVCache:
        """Layer 4's cache (sized by rank 0's part of the model); over several ranks its
        copy-on-write copies are sent to every rank."""
        if self.tp_group is None:
            return super().make_cache()
        net = self.model.net
        return RankedKVCache.for_group(self.tp_group, self.model.config, self.config.num_blocks,
                                       self.config.block_size, dtype=net.dtype, device=net.device)

    def make_runner(self) -> engine.ModelRunner:
        """Layer 4's runner; over several ranks the workers make their caches first, rank 0's
        waits are bounded (a pipeline's greedy steps take token ids from the last stage:
        pipeline_parallel/runner.py), and with cuda_graph (tensor parallelism) every rank
        captures its decode graphs, the workers at the same time as rank 0."""
        group = self.tp_group
        if group is None:
            return super().make_runner()
        self.worker_kv_bytes = group.make_caches(self.cache)
        kind = PPRunner if self.pipeline_parallel_size > 1 else RankZeroRunner
        runner = kind(self.model.net, self.cache, replace(self.config, cuda_graph=False))
        runner.group = group
        if self.config.cuda_graph and self.pipeline_parallel_size > 1:  # each stage's own
            capture_stage_graphs(group, self.model.net, self.cache, self.config)
            # decode steps from host arrays, where they fit (pipeline_parallel/runner.py)
            runner.graph = StageDecode(self.model.net)
        elif self.config.cuda_graph:  # tensor parallelism: the whole step, collectives inside
            runner.graph = capture_graphs(group, self.model.net, self.cache, self.config)
        group.steps_begin()  # the start-up is over: the step limit from here on
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

    # ---- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers and leave the process group (a no-op at one rank or when closed)."""
        group, self.tp_group = getattr(self, "tp_group", None), None
        if group is not None:
            runner = getattr(self, "runner", None)
            if group.error is None and getattr(runner, "graph", None) is not None:
                runner.graph.release()  # before the communicator its graphs captured
                runner.graph = None
            group.shutdown()
        launched, self.launched = getattr(self, "launched", None), None
        if launched is not None:
            launched.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- what each rank holds ------------------------------------------------------------------
    def rank_memory(self) -> list[dict[str, int]]:
        """Per rank: weight and KV-cache bytes ({"rank", "weights", "kv"})."""
        net = self.runner.net
        mine = net.shard if isinstance(net, RankZeroModel) else net
        rows = [{"rank": 0, "weights": weight_bytes(mine), "kv": self.cache.nbytes}]
        if self.tp_group is not None:
            for r, (info, kv) in enumerate(zip(self.tp_group.worker_info, self.worker_kv_bytes,
                                               strict=True), start=1):
                rows.append({"rank": r, "weights": info[3], "kv": kv})
        return rows

    @torch.no_grad()
    def prompt_logits(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        """fp32 logits (L_i, V) of every position of each token list, one prefill with no cache
        (through every rank): for comparing a parallel engine against one process."""
        net = self.runner.net
        lens = [len(t) for t in token_ids]
        flat = [t for seq in token_ids for t in seq]
        ids = torch.tensor(flat, dtype=torch.int64, device=net.device)
        slots = torch.zeros(len(flat), dtype=torch.int64)  # no cache: nothing is written
        ctx = l3.AttentionContext.build(lens, [0] * len(lens), slots, device=net.device)
        return list(net(ids, ctx, None).split(lens))


def _close_ref(ref: weakref.ref) -> None:
    llm = ref()
    if llm is not None:
        llm.close()
