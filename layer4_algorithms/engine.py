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

Extension point for speculative decoding (a `Speculator`): the scheduler reserves
`num_lookahead_slots` KV slots and budget per decoding sequence (ScheduledSeq.num_lookahead);
`propose(out)` fills ScheduledSeq.spec_token_ids (at most num_lookahead each); the runner
returns logits for the last real token and every draft; `verify(items)` returns the tokens
to append per sequence (accepted drafts + one) and records them in `counts` (SpecCounts:
the only place speculation is counted; `LLM.stats` reads it); the scheduler rolls the KV
back past the accepted ones (BlockManager.truncate) and calls `release(seq)` when a
sequence gives up its row (finish, abort, preemption).

Async scheduling (config.async_scheduling; SGLang's overlap scheduler, vLLM's async
scheduling): a step launches its GPU work and returns without waiting for its tokens. The
next `step()` schedules and launches step N+1 first, while the GPU still runs step N (a
decoding sequence's input is step N's sampled token, gathered on the device), and only then
reads step N's tokens (one host sync, behind work already queued), appends them, checks
stops and builds outputs. A sequence that finishes at step N has been scheduled for step
N+1 too: that token is discarded (its KV slot was its own; the blocks are freed at once,
and the GPU runs steps in order, so nobody reuses them before that write). One whose step-N
token reaches max_tokens is not scheduled again. Greedy outputs are the synchronous engine's.
A step that only samples first tokens (prefills reaching their prompt's end, no decode to
overlap) is read by the next call *before* it schedules anything, and that call returns at
once: the first tokens go out without waiting for another step's launch (at low load that
launch was pure time-to-first-token); the call after it launches with the tokens on the host.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

import layer3_model as l3

from .config import EngineConfig
from .engine_sampling import check_params, count_speculation, host_sampled, sample_rows
from .sampling_guard import normalize
from .engine_stats import EngineStatsMixin
from .kv import BlockManager, PagedKVCache, blocks_for_budget
from .model_runner import ModelRunner
from .outputs import ProgressBar, RequestOutput
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from .sequence import Sequence
from .spec import EngineSpeculator, Speculator
from .structured import GrammarCompiler, mask_spec

SamplingParams = l3.SamplingParams


class LLM(EngineStatsMixin):
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
        self.config = self.resolve(config)
        self.cache = self.make_cache()
        self.block_manager = BlockManager.from_config(self.config)
        if speculator is None and self.config.speculative is not None:
            speculator = EngineSpeculator.from_config(self.config, self.model)
        self.speculator = speculator
        self.config = replace(self.config, async_scheduling=self._async_flag(self.config))
        lookahead = speculator.num_lookahead_slots if speculator is not None else 0
        release = (speculator.release,) if speculator is not None else ()
        self.scheduler = Scheduler(self.block_manager, self.config,
                                   num_lookahead_slots=lookahead, on_release=release)
        self.runner = self.make_runner()
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._requests: dict[str, tuple[object, list[Sequence]]] = {}  # id -> (prompt, seqs)
        self._inflight: _Launched | None = None  # async scheduling: the step on the GPU
        self._host_sampling = 0  # live requests with penalties / logprobs / grammars: run sync
        self.grammars = GrammarCompiler.for_model(self.model)  # structured outputs (lazy)
        self.closed = False
        self.reset_stats()

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

    def _async_flag(self, config: EngineConfig) -> bool:
        """config.async_scheduling resolved: None -> on for a CUDA model without a speculator."""
        if self.speculator is not None:
            if config.async_scheduling:
                raise ValueError("async_scheduling=True does not work with speculative decoding "
                                 "(verification reads the tokens on the host every step)")
            return False
        if config.async_scheduling is None:
            return self.model.net.device.type == "cuda"
        return config.async_scheduling

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

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | Seq[int], params: l3.SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0) -> str:
        """Queue a prompt (text, or token ids); returns its request id. ValueError for an
        empty or unknown-token prompt, one that cannot fit (max_model_len, the KV pool), or
        penalties / logprobs under speculation. priority: lower runs sooner (scheduling
        "priority"; the other policies ignore it)."""
        if self.closed:
            raise RuntimeError("the engine is closed")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        params = normalize(params if params is not None else SamplingParams())
        check_params(params, self.speculator is not None)
        ids = self.model.encode(prompt)
        rid = str(next(self._request_ids)) if request_id is None else str(request_id)
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        seq = self._sequence(rid, ids, params, 0, time.perf_counter(), priority)
        self.scheduler.add(seq)
        self._requests[rid] = (prompt, [seq])
        self._host_sampling += host_sampled(params)
        return rid

    def _sequence(self, rid: str, ids: list[int], params: l3.SamplingParams, index: int,
                  arrival: float, priority: int) -> Sequence:
        seq = Sequence(next(self._seq_ids), rid, ids, params, index=index,
                       generator=self._generator(params, index), decoder=self._decoder(),
                       eos_token_ids=self.model.eos_token_ids, arrival_time=arrival,
                       priority=priority)
        if params.structured_outputs is not None:  # its grammar compiles from now on
            seq.grammar = self.grammars.state(params.structured_outputs)
        return seq

    def _generator(self, params: l3.SamplingParams, index: int) -> torch.Generator:
        """Completion `index` of a seeded request draws from seed + index: reproducible, and
        the n completions differ."""
        seeded = params if params.seed is None else SamplingParams(seed=params.seed + index)
        return l3.make_generator(seeded, self.model.device)

    def _decoder(self) -> l3.IncrementalDecoder | None:
        return self.model.tokenizer.decoder() if self.model.tokenizer else None

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now (its blocks are freed); its output so far, finish reason "abort"."""
        if request_id not in self._requests:
            return None
        self.scheduler.abort(request_id)
        prompt, seqs = self._requests.pop(request_id)
        self._host_sampling -= host_sampled(seqs[0].params)
        for s in seqs:
            s.finish_reason = s.finish_reason or "abort"
        seqs[0].pending_forks = 0
        return RequestOutput.of(request_id, prompt, seqs, time.perf_counter())

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
        advanced: set[str] = set()
        finished: list[Sequence] = []
        if prev is not None and not sync and prev.first_only:
            # nothing to overlap but a launch that would delay the first tokens: read them now
            self._complete(prev, advanced, finished)
            return self._end_step(start, advanced, finished, unfinished, delta)
        if prev is not None and sync:  # a synchronous step needs every token on the host
            self._complete(prev, advanced, finished)
            prev = None
        out = self.scheduler.schedule()
        if out.scheduled:
            launched = self._launch(out, prev, sync)
        elif prev is None and not advanced and self.scheduler.has_unfinished():
            raise RuntimeError(
                f"the scheduler made no progress with {len(self.scheduler.waiting)} waiting "
                f"and {len(self.scheduler.running)} running sequences (a bug: requests are "
                f"checked to fit when added)")
        else:
            launched = None
        if prev is not None:  # step N's tokens, read while the GPU runs step N+1
            self._complete(prev, advanced, finished)
        if launched is not None:
            if launched.tokens is None:
                self._complete(launched, advanced, finished)
            else:
                self._inflight = launched
        return self._end_step(start, advanced, finished, unfinished, delta)

    def _end_step(self, start: float, advanced: set[str], finished: list[Sequence],
                  unfinished: bool, delta: bool) -> list[RequestOutput]:
        now = time.perf_counter()
        self._stats.elapsed_s += now - start
        if not unfinished:  # only the requests that finished: no output for the others
            advanced = {q.request_id for q in finished}
        return self._outputs(advanced, unfinished, now, delta)

    def _launch(self, out: SchedulerOutput, prev: _Launched | None, sync: bool) -> _Launched:
        """Run the scheduled step and sample it. sync: the tokens come back as a list (one
        host sync; penalties, logprobs and speculation take this path), else they stay on the
        device and are copied back without waiting (read by `_complete`)."""
        if self.speculator is not None:
            self.speculator.propose(out)
        if prev is None:
            logits = self.runner.execute(out)
        else:  # decoding sequences' inputs are prev's tokens, still on the device
            logits = self.runner.execute(out, prev.device_tokens)
        row_ids, who, spec = [], [], []
        rows = logits.row
        for i, s in enumerate(list(out.scheduled)):  # a copy: forks append to it
            if rows[i] is None:
                continue
            if s.spec_token_ids:
                spec.append((s, logits.spec[i]))
                continue
            if s.seq.pending_forks:
                seqs = [s.seq] + self._fork(s, out)
                row_ids += [rows[i]] * len(seqs)  # parallel-sampling children share the row
                who += seqs
            else:
                row_ids.append(rows[i])
                who.append(s.seq)
        self._stats.steps += 1
        self._stats.batched_tokens += sum(s.num_new_tokens + len(s.spec_token_ids)
                                          for s in out.scheduled)
        launched = _Launched(out, who)
        if sync:
            tokens = sample_rows(self.runner, logits.rows_of(row_ids), who)
            launched.sampled = {q.seq_id: [t] for q, t in zip(who, tokens, strict=True)}
            launched.bad = self.runner.last_bad
            if spec:
                mask_spec(spec)  # constrained sequences: drafts checked against the grammar
                verified = self.speculator.verify(spec)
                count_speculation(spec, verified)
                launched.sampled.update(verified)
            return launched
        tokens = self.runner.sample_tokens(logits.rows_of(row_ids), [q.params for q in who],
                                           [q.generator for q in who])
        launched.device_tokens = tokens
        launched.bad = self.runner.last_bad
        # every sampled row is a first token (no sequence here is decoding)
        launched.first_only = bool(who) and all(q.num_tokens == q.num_prompt_tokens for q in who)
        if tokens.device.type == "cuda":  # back to pinned memory behind the step's kernels
            launched.tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            launched.tokens.copy_(tokens, non_blocking=True)
            if launched.bad is not None:  # with the tokens, behind the same event
                bad, launched.bad = launched.bad, torch.empty(launched.bad.shape,
                                                              dtype=torch.bool, pin_memory=True)
                launched.bad.copy_(bad, non_blocking=True)
            launched.event = torch.cuda.Event()
            launched.event.record()
        else:
            launched.tokens = tokens
        for j, q in enumerate(who):
            q.num_pending += 1
            q.pending_index = j
        return launched

    def _complete(self, launched: _Launched, advanced: set[str],
                  finished: list[Sequence]) -> None:
        """Read a launched step's tokens (waiting for them if still on the GPU), append them,
        free what finished; adds the requests it advanced and the sequences it finished."""
        sampled = launched.sampled
        if sampled is None:
            if launched.event is not None:
                launched.event.synchronize()
            who = launched.who
            for q in who:
                q.num_pending -= 1
            tokens = launched.tokens.tolist()
            sampled = {q.seq_id: [t] for q, t in zip(who, tokens, strict=True)}
        void = self._void_rows(launched, sampled)
        finished += self.scheduler.postprocess(launched.out, sampled)
        for rid in void:  # the request's other completions end with it
            finished += self.scheduler.abort(rid)
        advanced.update(s.seq.request_id for s in launched.out.scheduled)

    def _void_rows(self, launched: _Launched, sampled: dict[int, list[int]]) -> set[str]:
        """Sequences whose row could not be sampled (sampling_guard.py) get no token and
        finish with reason "error": postprocess frees them. Returns their request ids."""
        if launched.bad is None:
            return set()
        void = set()
        for q, bad in zip(launched.who, launched.bad.tolist(), strict=True):
            if bad and q.finish_reason is None:
                sampled.pop(q.seq_id, None)
                q.finish_reason = "error"
                void.add(q.request_id)
        return void

    def _fork(self, parent: ScheduledSeq, out: SchedulerOutput) -> list[Sequence]:
        p = parent.seq
        children = [p.fork(next(self._seq_ids), i, self._generator(p.params, i), self._decoder())
                    for i in range(1, p.params.n)]
        self.scheduler.fork(parent, children, out)
        self._requests[p.request_id][1].extend(children)
        return children

    def _outputs(self, request_ids: set[str], unfinished: bool, now: float,
                 delta: bool = False) -> list[RequestOutput]:
        def wanted(rid: str) -> bool:  # building an output copies every token list: only if asked
            if rid not in self._requests:
                return False
            seqs = self._requests[rid][1]
            done = seqs[0].pending_forks == 0 and all(s.finish_reason is not None for s in seqs)
            return unfinished or done

        def order(rid: str) -> int:
            return self._requests[rid][1][0].seq_id

        outs = []
        for rid in sorted(filter(wanted, request_ids), key=order):
            prompt, seqs = self._requests[rid]
            o = RequestOutput.of(rid, prompt, seqs, now, delta=delta)
            if o.finished:
                del self._requests[rid]
                self._host_sampling -= host_sampled(seqs[0].params)
                self._count_finished(o)
            outs.append(o)
        return outs

    def drain(self) -> list[RequestOutput]:
        """Wait for the step still on the GPU (async scheduling) and apply it: returns the
        outputs of the requests it finished. generate() calls it when nothing is left."""
        prev, self._inflight = self._inflight, None
        if prev is None:
            return []
        advanced: set[str] = set()
        finished: list[Sequence] = []
        self._complete(prev, advanced, finished)
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
        try:
            while len(done) < len(ids):
                for o in self.step(unfinished=False):
                    done[o.request_id] = o
                if bar:
                    bar.update(len(done), self.stats)
            if not self.has_unfinished():  # what is still on the GPU only finishes nothing
                self.drain()
        finally:
            if bar:
                bar.close()
        return [done[rid] for rid in ids]


@dataclass
class _Launched:
    """A step on its way: what was scheduled, who samples (in row order), and the tokens:
    `sampled` (seq_id -> tokens) when read synchronously, else `tokens` (a pinned host copy
    of `device_tokens` in flight until `event`; on a CPU the tensor itself)."""

    out: SchedulerOutput
    who: list[Sequence]
    sampled: dict[int, list[int]] | None = None
    device_tokens: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    first_only: bool = False  # only first tokens sampled: the next step() reads it first
    bad: torch.Tensor | None = None  # (len(who),) bool: rows sampling could not draw (void)
