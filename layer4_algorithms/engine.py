"""The offline engine, vLLM's `LLM`: requests in, completions out, one step at a time.

    llm = LLM("models/course-target", num_blocks=512, block_size=16)
    outs = llm.generate(["ROMEO.\\n", "JULIET.\\n"], SamplingParams(temperature=0.8, max_tokens=64, n=2))
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
to append per sequence (accepted drafts + one); the scheduler rolls the KV back past the
accepted ones (BlockManager.truncate) and calls `release(seq)` when a sequence gives up its
row (finish, abort, preemption).
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Protocol

import torch

import layer3_model as l3

from .block_manager import BlockManager, PrefixCacheStats
from .model_runner import DEFAULT_ATTN_BYTES_LIMIT, ModelRunner
from .outputs import EngineStats, ProgressBar, RequestOutput
from .paged_cache import PagedKVCache, blocks_for_budget
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from .sequence import SamplingParams, Sequence
from .spec_engine import EngineSpeculator


class Speculator(Protocol):
    num_lookahead_slots: int

    def propose(self, out: SchedulerOutput) -> None: ...

    def verify(self, items: list[tuple[ScheduledSeq, torch.Tensor]]) -> dict[int, list[int]]: ...

    def release(self, seq: Sequence) -> None: ...


class LLM:
    """model: a checkpoint directory or a loaded layer-3 Model. KV budget: num_blocks, or
    kv_cache_bytes, or (default) gpu_memory_utilization of free GPU memory / 512 MiB on CPU.
    scheduling: "continuous" or "static" (the baseline: fixed batches run to completion)."""

    def __init__(self, model: str | Path | l3.Model, *, backend: str = "torch", dtype: str | torch.dtype | None = None,
                 device: str | torch.device | None = None, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_bytes: int | None = None, gpu_memory_utilization: float = 0.85, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 scheduling: str = "continuous", cuda_graph: bool = False,
                 attn_bytes_limit: int = DEFAULT_ATTN_BYTES_LIMIT, speculator: Speculator | None = None,
                 speculative: dict | None = None) -> None:
        self.model = model if isinstance(model, l3.Model) else l3.load(model, backend=backend, dtype=dtype, device=device)
        net, config = self.model.net, self.model.config
        self.max_model_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        if num_blocks is not None and kv_cache_bytes is not None:
            raise ValueError("give num_blocks or kv_cache_bytes, not both")
        if num_blocks is None:
            num_blocks = blocks_for_budget(config, block_size, net.dtype, num_bytes=kv_cache_bytes,
                                           device=net.device, gpu_memory_utilization=gpu_memory_utilization)
        self.cache = PagedKVCache.for_model(config, num_blocks, block_size, dtype=net.dtype, device=net.device)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=self.max_model_len,
                                   enable_chunked_prefill=enable_chunked_prefill, policy=scheduling)
        self.runner = ModelRunner(net, self.cache, attn_bytes_limit=attn_bytes_limit, cuda_graph=cuda_graph,
                                  max_num_seqs=max_num_seqs, max_model_len=self.max_model_len)
        if speculative is not None:
            speculator = EngineSpeculator.for_engine(self, **speculative)
        self.speculator = speculator
        if speculator is not None:
            self.scheduler.num_lookahead_slots = speculator.num_lookahead_slots
            self.scheduler.on_release.append(speculator.release)
        self._seq_ids, self._request_ids = itertools.count(), itertools.count()
        self._requests: dict[str, tuple[object, list[Sequence]]] = {}  # id -> (prompt, its sequences)
        self.reset_stats()

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | Seq[int], params: l3.SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a prompt (text, or token ids); returns its request id. ValueError for an
        empty or unknown-token prompt, or one that cannot fit (max_model_len, the KV pool)."""
        params = SamplingParams.of(params)
        ids = self.model.encode(prompt)
        rid = str(next(self._request_ids)) if request_id is None else str(request_id)
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        seq = self._sequence(rid, ids, params, 0, time.perf_counter())
        self.scheduler.add(seq)
        self._requests[rid] = (prompt, [seq])
        return rid

    def _sequence(self, rid: str, ids: list[int], params: SamplingParams, index: int, arrival: float) -> Sequence:
        return Sequence(next(self._seq_ids), rid, ids, params, index=index, generator=self._generator(params, index),
                        decoder=self._decoder(), eos_token_ids=self.model.eos_token_ids, arrival_time=arrival)

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator:
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
        for s in seqs:
            s.finish_reason = s.finish_reason or "abort"
        seqs[0].pending_forks = 0
        return RequestOutput.of(request_id, prompt, seqs, time.perf_counter())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------------------
    def step(self, *, unfinished: bool = True) -> list[RequestOutput]:
        """Run one step. Returns outputs of the requests it advanced (finished ones included;
        unfinished=False: only the requests that finished in it)."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError(f"the scheduler made no progress with {len(self.scheduler.waiting)} waiting and "
                                   f"{len(self.scheduler.running)} running sequences (a bug: requests are checked "
                                   f"to fit when added)")
            return []
        if self.speculator is not None:
            self.speculator.propose(out)
        logits = self.runner.execute(out)
        row_ids, who, spec = [], [], []
        for i, s in enumerate(list(out.scheduled)):  # a copy: forks append to it
            if logits.row[i] is None:
                continue
            if s.spec_token_ids:
                spec.append((s, logits.spec[i]))
                continue
            seqs = [s.seq] + (self._fork(s, out) if s.seq.pending_forks else [])
            row_ids += [logits.row[i]] * len(seqs)  # parallel-sampling children share the row
            who += seqs
        tokens = self.runner.sample(logits.rows_of(row_ids), [q.params for q in who], [q.generator for q in who])
        sampled = {q.seq_id: [t] for q, t in zip(who, tokens, strict=True)}
        if spec:
            verified = self.speculator.verify(spec)
            for s, _ in spec:
                self.stats.spec_proposed += len(s.spec_token_ids)
                self.stats.spec_accepted += len(verified[s.seq.seq_id]) - 1
            sampled.update(verified)
        self.scheduler.postprocess(out, sampled)
        now = time.perf_counter()
        self.stats.steps += 1
        self.stats.batched_tokens += sum(s.query_len for s in out.scheduled)
        self.stats.elapsed_s += now - start
        return self._outputs({s.seq.request_id for s in out.scheduled}, unfinished, now)

    def _fork(self, parent: ScheduledSeq, out: SchedulerOutput) -> list[Sequence]:
        p = parent.seq
        children = [p.fork(next(self._seq_ids), i, self._generator(p.params, i), self._decoder())
                    for i in range(1, p.params.n)]
        self.scheduler.fork(parent, children, out)
        self._requests[p.request_id][1].extend(children)
        return children

    def _outputs(self, request_ids: set[str], unfinished: bool, now: float) -> list[RequestOutput]:
        def wanted(rid: str) -> bool:  # building an output copies every token list: only when asked
            if rid not in self._requests:
                return False
            seqs = self._requests[rid][1]
            return unfinished or (seqs[0].pending_forks == 0 and all(s.finish_reason is not None for s in seqs))

        outs = []
        for rid in sorted(filter(wanted, request_ids), key=lambda r: self._requests[r][1][0].seq_id):
            prompt, seqs = self._requests[rid]
            o = RequestOutput.of(rid, prompt, seqs, now)
            if o.finished:
                del self._requests[rid]
                st = self.stats
                st.requests += 1
                st.prompt_tokens += o.metrics.num_prompt_tokens
                st.generated_tokens += sum(len(c.token_ids) for c in o.outputs)
                st.ttfts.append(o.metrics.ttft)
                if o.metrics.tpot is not None:
                    st.tpots.append(o.metrics.tpot)
            outs.append(o)
        return outs

    # ---- the loop ------------------------------------------------------------------------------
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
        finally:
            if bar:
                bar.close()
        return [done[rid] for rid in ids]

    # ---- statistics ----------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self._stats = EngineStats()
        self.block_manager.stats = PrefixCacheStats()
        self._preemptions_before = self.scheduler.num_preemptions

    @property
    def stats(self) -> EngineStats:
        s, p = self._stats, self.block_manager.stats
        s.preemptions = self.scheduler.num_preemptions - self._preemptions_before
        s.prefix_queried_tokens, s.prefix_hit_tokens = p.queried_tokens, p.hit_tokens
        return s

