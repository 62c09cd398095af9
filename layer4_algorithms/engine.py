"""The offline engine, vLLM's `LLM`: requests in, completions out, one step at a time.

    llm = LLM("models/course-target", EngineConfig(num_blocks=512, block_size=16))
    params = SamplingParams(temperature=0.8, max_tokens=64, n=2)
    outs = llm.generate(["ROMEO.\\n", "JULIET.\\n"], params)
    outs[0].outputs[1].text, outs[0].metrics.ttft, llm.stats.prefix_hit_rate

One `step()`: the scheduler picks the step's sequences and token counts, the model runner
runs them through the model over the paged cache, tokens are sampled (or, with a
speculator, verified), and the scheduler advances every sequence and frees the finished.
`add_request` / `abort` / `step` / `has_unfinished` are the pieces an online server
(layer 6) drives; `generate` is the loop for a fixed list of prompts.

Speculative decoding plugs in as a `Speculator` (spec/engine_hook.py: the scheduler reserves
lookahead slots, `propose` fills drafts, `verify` returns the tokens to append and counts
them; the scheduler rolls the KV back past the rejected ones).

Async scheduling (config.async_scheduling): a step launches its GPU work and returns without
waiting for its tokens; the next step() reads them while the GPU runs its own launch
(launched_step.py tells how, and why a step of first tokens only is read at once).
Constrained requests (structured outputs) keep it: a step with grammar rows launches its
forward pass, then reads the previous step's tokens (their copy to the host was queued
ahead of this forward, so the wait is short), advances the grammars with them, fills the
masks on the host while the GPU runs the forward, and only then masks and samples
(structured/).

`step()` in order: read the previous launch if this step needs its tokens first, schedule,
launch (`_launch`, engine_launch.py: speculation's proposals, the model, the rows to sample with
parallel-sampling forks, sampling on the host or on the device), read the previous launch
while this one runs, and build the outputs of the requests it advanced.
"""
from __future__ import annotations

import gc
import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import fields, replace
from pathlib import Path

import layer3_model as l3

from .config import EngineConfig
from .engine_launch import EngineLaunchMixin
from .engine_requests import EngineRequestsMixin
from .engine_stats import EngineStatsMixin
from .kv import BlockManager, PagedKVCache, blocks_for_budget
from .launched_step import LaunchedStep
from .model_runner import ModelRunner, prefill_graphs_wanted
from .outputs import ProgressBar, RequestOutput
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence
from .spec import EngineSpeculator, Speculator
from .structured import GrammarCompiler, TokenMasks, default_lanes


class LLM(EngineLaunchMixin, EngineRequestsMixin, EngineStatsMixin):
    """The engine. model: a checkpoint directory, or an already-loaded layer-3 `Model` (its
    `.net` runs the steps; the KV cache is sized from its `.config`). config: an EngineConfig
    (default EngineConfig()); keyword overrides are applied to it with dataclasses.replace,
    so `LLM(path, num_blocks=512, max_num_seqs=8)` works as in vLLM. speculator: a custom
    Speculator (else one is built from config.speculative, if set). `llm.config` is the
    config the engine runs with (max_model_len and num_blocks resolved from the model).

    Extending it (layer 5): pass a Model whose `.net` is a parallel wrapper with LlamaModel's
    forward signature and whose `.config` has the per-rank head counts, and the cache and
    runner follow it; or subclass LLM and override `make_runner` (the runner, and the
    network it runs) or `make_cache` (the KV tensors); both are called once, in __init__,
    after `self.model` and `self.config` are set. An EngineConfig subclass with more fields
    passes through unchanged. `close()` (or `with LLM(...) as llm:`) ends its use; layer 5's
    tensor-parallel engine stops its workers there."""

    def __init__(self, model: str | Path | l3.Model, config: EngineConfig | None = None, *,
                 speculator: Speculator | None = None, **overrides) -> None:
        config = config if config is not None else EngineConfig()
        unknown = sorted(set(overrides) - {f.name for f in fields(config)})
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(unknown)}: "
                            f"{type(config).__name__} has no such field")
        config = replace(config, **overrides) if overrides else config
        if speculator is not None and config.speculative is not None:
            raise ValueError("give a speculator or config.speculative, not both")
        if isinstance(model, l3.Model):
            self.model = model
        else:
            self.model = l3.load(model, backend=config.backend, dtype=config.dtype,
                                 device=config.device)
        attention = self.use_prefill_attention(config.prefill_attention)
        self.config = self.resolve(config)
        self.cache = self.make_cache()
        self.block_manager = BlockManager.from_config(self.config)
        if speculator is None and self.config.speculative is not None:
            speculator = EngineSpeculator.from_config(self.config, self.model)
        self.speculator = speculator
        overlap = self.config.async_for(self.model.net.device.type, speculator is not None)
        lanes = self.config.grammar_fill_threads or default_lanes(self.model.net.device.type)
        prefill = self.config.prefill_cuda_graph  # None: with cuda_graph, where it works
        if prefill is None:  # (decided here, once)
            prefill = self.config.cuda_graph and prefill_graphs_wanted(None, self.model.net)
        self.config = replace(self.config, async_scheduling=overlap, grammar_fill_threads=lanes,
                              prefill_cuda_graph=prefill, prefill_attention=attention)
        lookahead = speculator.num_lookahead_slots if speculator is not None else 0
        release = (speculator.release,) if speculator is not None else ()
        self.scheduler = Scheduler(self.block_manager, self.config,
                                   num_lookahead_slots=lookahead, on_release=release)
        self.runner = self.make_runner()
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._requests: dict[str, tuple[object, list[Sequence]]] = {}  # id -> (prompt, seqs)
        self._inflight: LaunchedStep | None = None  # async scheduling: the step on the GPU
        self._retired: list = []  # finished requests, freed behind the next launch
        self._unnormalized: list[str] = []  # requests whose id lists get ints behind it
        self._host_sampling = 0  # live requests with penalties / logprobs: run sync
        self._grammars_live = 0  # live requests with structured outputs
        self._random_live = 0  # live requests sampling at a temperature > 0 (not greedy)
        lanes = self.config.grammar_fill_threads
        self.grammars = GrammarCompiler.for_model(self.model, lanes=lanes)  # (lazy)
        self.masks = TokenMasks(self.model.config.vocab_size, self.model.net.device,
                                rows=self.config.max_num_seqs,  # buffers made on first use
                                graphs=self.config.cuda_graph,  # (the apply's graphs)
                                fill_threads=lanes)
        self.closed = False
        self.reset_stats()

    def use_prefill_attention(self, name: str | None) -> str:
        """Set the network's attention for a lone prompt (config.prefill_attention) where it
        differs, and return it: a LlamaModel's set_backend checks it (the triton backend,
        CUDA, fp16/bf16); a network without one (layer 5's wrappers) takes only "flash".
        None: "cudnn" where those hold, else "flash"."""
        net = self.model.net
        if name is None:
            name = "cudnn" if l3.cudnn_attention_works(net) else "flash"
        if name == getattr(net, "prefill_attention", "flash"):
            return name
        if not hasattr(net, "set_backend"):
            raise ValueError(f"prefill_attention={name!r} needs a layer-3 LlamaModel network "
                             f"(set_backend); this engine's is a {type(net).__name__}")
        net.set_backend(net.backend, impl=net.ops.impl, prefill_attention=name)
        return name

    def resolve(self, config: EngineConfig) -> EngineConfig:
        """The config with the model-dependent knobs filled in: max_model_len capped by the
        model's max_position_embeddings, num_blocks from the byte budget when not given."""
        mc, net = self.model.config, self.model.net
        limit = mc.max_position_embeddings
        max_model_len = min(config.max_model_len or limit, limit)
        num_blocks = config.num_blocks
        if num_blocks is None:
            num_blocks = blocks_for_budget(
                mc, config.block_size, net.dtype, num_bytes=config.kv_cache_bytes,
                device=net.device, gpu_memory_utilization=config.gpu_memory_utilization)
        return replace(config, max_model_len=max_model_len, num_blocks=num_blocks,
                       kv_cache_bytes=None)

    def make_cache(self) -> PagedKVCache:
        """The paged KV pool, shaped by the model's config (per-rank heads under layer 5)."""
        net = self.model.net
        return PagedKVCache.for_model(self.model.config, self.config.num_blocks,
                                      self.config.block_size, dtype=net.dtype, device=net.device)

    def make_runner(self) -> ModelRunner:
        """The runner of the steps: override to run a different network over self.cache."""
        return ModelRunner(self.model.net, self.cache, self.config)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # ---- requests: add_request, abort (engine_requests.py) ----------------------------------
    def has_unfinished(self) -> bool:
        """True while a request is waiting or running. (Under async scheduling a step may
        still be on the GPU when this is False: its tokens all belong to finished requests.)"""
        return self.scheduler.has_unfinished()

    def close(self) -> None:
        """Mark the engine closed (nothing to free on one process; layer 5 overrides it)."""
        self.closed = True

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the step --------------------------------------------------------------------------
    def step(self, *, unfinished: bool = True, delta: bool = False) -> list[RequestOutput]:
        """Run one step. Returns outputs of the requests it advanced (finished ones included;
        unfinished=False: only the requests that finished in it). Under async scheduling the
        step launched here is read by the next call: the outputs are the previous step's.
        delta=True: each completion holds only what is new since its last delta output
        (RequestOutput.of), not a copy of everything so far: what a server streaming many
        requests wants; a caller uses one mode for a request's whole life."""
        start = time.perf_counter()
        prev, self._inflight = self._inflight, None
        sync = not self.config.async_scheduling or self._host_sampling > 0
        advanced: list[SchedulerOutput] = []  # the steps whose tokens were appended
        finished: list[Sequence] = []
        if prev is not None and (sync or prev.first_only):
            # before scheduling: a synchronous step needs every token on the host, and a
            # launch of first tokens only has nothing to overlap
            self._complete(prev, advanced, finished)
            prev = None
            if not sync:  # first tokens only: out now, before another launch delays them
                return self._end_step(start, advanced, finished, unfinished, delta)
        launched = self._advance(prev, sync, advanced, finished)
        if (launched is not None and launched.first_only and not self.scheduler.waiting
                and launched.on_gpu()):
            # prompts' first tokens still being computed, nobody waiting to be admitted: the
            # next step is their first decode (with the other running sequences'). Launched
            # now, queued behind the prefill, while the first tokens are read: the GPU goes
            # from one to the other without waiting for the host, and the first tokens wait
            # only for this launch's host time, spent while the prefill still runs.
            self._inflight = None
            self._advance(launched, sync, advanced, finished)
        return self._end_step(start, advanced, finished, unfinished, delta)

    def _advance(self, prev: LaunchedStep | None, sync: bool, advanced: list[SchedulerOutput],
                 finished: list[Sequence]) -> LaunchedStep | None:
        """Schedule and launch a step, reading prev's tokens while it runs. Returns the step
        left in flight (self._inflight: its tokens on their way, read by the next call), or
        None (nothing launched, or its tokens read here)."""
        out = self.scheduler.schedule()
        launched = None
        if out.scheduled:
            launched, prev = self._launch(out, prev, sync, advanced, finished)
            self._retired.clear()  # (while the GPU runs the launch)
            self.block_manager.drain()  # the blocks of those finished since the last launch
            if self._unnormalized:
                self._normalize_prompts()
        if launched is None and prev is None and not advanced:
            self._check_progress()
        if prev is not None:  # step N's tokens, read while the GPU runs step N+1
            self._complete(prev, advanced, finished)
        if launched is not None and launched.sampled is None:
            self._inflight = launched  # its tokens are still on their way: the next step reads them
            return launched
        if launched is not None:
            self._complete(launched, advanced, finished)
        return None

    def _check_progress(self) -> None:
        if self.scheduler.has_unfinished():
            raise RuntimeError(
                f"the scheduler made no progress with {len(self.scheduler.waiting)} waiting "
                f"and {len(self.scheduler.running)} running sequences (a bug: requests are "
                f"checked to fit when added)")

    def _end_step(self, start: float, advanced: list[SchedulerOutput], finished: list[Sequence],
                  unfinished: bool, delta: bool) -> list[RequestOutput]:
        """The outputs of the requests advanced."""
        now = time.perf_counter()
        if not unfinished:  # only the requests that finished: no output for the others
            ids = {q.request_id for q in finished}
        else:
            ids = {s.seq.request_id for o in advanced for s in o.scheduled}
        try:
            return self._outputs(ids, unfinished, now, delta)
        finally:
            self._stats.elapsed_s += time.perf_counter() - start

    def _complete(self, launched: LaunchedStep, advanced: list[SchedulerOutput],
                  finished: list[Sequence]) -> None:
        """Read a launched step's tokens (waiting for them if still on the GPU), append them,
        free what finished; adds the step (its requests advanced) and the sequences it
        finished. (The requests' ids are gathered only for outputs of unfinished ones.)"""
        out = launched.out
        # a step of plain decodes sampled every scheduled sequence's row, in order (no fork,
        # no void row possible when bad is None): its tokens are appended as a list
        if launched.bad is None and out.plain_decodes == len(out.scheduled) == len(launched.who):
            tokens = launched.read_tokens()
            if tokens is not None:
                finished += self.scheduler.postprocess(out, None, in_order=tokens)
                advanced.append(out)
                return
        sampled = launched.read()
        void = launched.void_rows(sampled)
        finished += self.scheduler.postprocess(out, sampled)
        for rid in void:  # the request's other completions end with it
            finished += self.scheduler.abort(rid)
        advanced.append(out)

    def drain(self) -> list[RequestOutput]:
        """Wait for the step still on the GPU (async scheduling) and apply it: returns the
        outputs of the requests it finished. generate() calls it when nothing is left."""
        prev, self._inflight = self._inflight, None
        if prev is None:
            return []
        finished: list[Sequence] = []
        self._complete(prev, [], finished)
        return self._outputs({q.request_id for q in finished}, False, time.perf_counter())

    # ---- the loop --------------------------------------------------------------------------
    def generate(self, prompts: str | Seq[int] | Seq[str | Seq[int]],
                 params: l3.SamplingParams | Seq[l3.SamplingParams] | None = None, *,
                 progress: bool = False) -> list[RequestOutput]:
        """Run prompts (texts or token-id lists) to completion: outputs in prompt order.
        Resets stats first. progress: a rich progress bar with live throughput."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("no prompts given")
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        self.reset_stats()
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, plist, strict=True):
                ids.append(self.add_request(p, sp))
        except Exception:
            for rid in ids:  # all or nothing: no half-queued batch left behind
                self.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        bar = ProgressBar(len(ids)) if progress else None
        # Everything alive now (the model, the cache, the engine) sits out of the garbage
        # collector's way until the loop ends: a full collection would walk it all (~0.15 s for
        # engine_host_time's 300k objects on a 2-core CPU), and the steps' short-lived objects,
        # promoted while a step is in flight, trigger one every ~1000 steps. Unfrozen after
        # (nothing leaks); left alone when someone else froze the heap (layer 6's worker).
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        try:
            while len(done) < len(ids):
                for o in self.step(unfinished=False):
                    done[o.request_id] = o
                if bar:
                    bar.update(len(done), self.stats)
            if not self.has_unfinished():  # what is still on the GPU only finishes nothing
                self.drain()
        finally:
            if freeze:
                gc.unfreeze()
            if bar:
                bar.close()
        return [done[rid] for rid in ids]

