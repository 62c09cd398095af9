"""The engine's requests: adding one (a Sequence per completion; parallel-sampling children
are forked from it at its first token), aborting one, and building the outputs of those a
step advanced. Kept apart from the step loop (engine.py)."""
from __future__ import annotations

import struct
import time
from collections.abc import Sequence as Seq

import numpy as np
import torch

import layer3_model as l3

from .engine_sampling import check_params, host_sampled
from .outputs import RequestOutput
from .packed_ints import packed
from .sampling_guard import normalize
from .scheduler import ScheduledSeq, SchedulerOutput
from .sequence import Sequence


class EngineRequestsMixin:
    """For LLM: reads self.model, self.scheduler, self.speculator, self.grammars; keeps
    self._requests (id -> (prompt, its sequences)) and the counts of live requests that need
    host sampling, grammars, or random sampling (temperature > 0)."""

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
        params = normalize(params if params is not None else l3.SamplingParams())
        check_params(params, self.speculator is not None)
        ids, array = self._encode(prompt)
        rid = str(next(self._request_ids)) if request_id is None else str(request_id)
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        seq = self._sequence(rid, ids, params, 0, time.perf_counter(), priority, array)
        self.scheduler.add(seq)
        self._requests[rid] = (prompt, [seq])
        self._count_live(params, 1)
        if array is not None:  # its lists still hold the caller's items
            self._unnormalized.append(rid)
        return rid

    def _encode(self, prompt: str | Seq[int]) -> tuple[Seq[int], np.ndarray | None]:
        """The prompt's token ids, and for a prompt of token ids the same as an int64 array
        (the runner's input ids are slices of it: no per-token conversion each step). A list
        or tuple of ints (or of what has __index__: bools, numpy ints) is packed and checked
        in C (the model's encode calls int() on each and scans twice more: ~0.2 ms for 2k
        tokens) and returned as it is: its items have the ids' values, hash and compare as
        them, and are replaced by ints behind the next launch (_normalize_prompts); anything
        else (floats, strings, ...), or ids out of the vocabulary, goes through the model's
        encode, whose ids, checks and errors are the engine's."""
        if isinstance(prompt, list | tuple) and prompt:
            try:  # packed in C (half np.fromiter's instructions), as a read-only array;
                # unsigned: a negative id fails here, so one bound is left to check
                array = packed(prompt, "Q")
            except (struct.error, TypeError, ValueError, OverflowError):  # (floats, strings..)
                array = None
            if array is not None and array.max() < self.model.config.vocab_size:
                return prompt, array.view(np.int64)
        return self.model.encode(prompt), None

    def _normalize_prompts(self, only: str | None = None) -> None:
        """The token lists of the prompts added as ids since the last launch (every sequence
        of the request, forks included) made of ints: the engine runs this behind a launch
        (2k ids to ints take ~50 us, which the GPU's work then hides) and before it builds an
        output. only: that request's alone (an abort)."""
        todo = self._unnormalized
        if only is not None:
            if only not in todo:
                return
            todo.remove(only)
            todo = [only]
        for rid in todo:
            req = self._requests.get(rid)
            if req is None:
                continue
            seqs = req[1]
            ids = seqs[0].prompt_array.tolist()
            n = len(ids)
            for q in seqs:  # (in place: the lists keep their identity)
                q.prompt_ids[:] = ids
                q.token_ids[:n] = ids
        if only is None:
            todo.clear()

    def _count_live(self, params: l3.SamplingParams, sign: int) -> None:
        """A request joins (sign 1) or leaves (-1) the live counts that pick the step's
        sampling: host sampling, grammars, random sampling (temperature > 0)."""
        self._host_sampling += sign * host_sampled(params)
        self._grammars_live += sign * (params.structured_outputs is not None)
        self._random_live += sign * (not params.greedy)

    def _sequence(self, rid: str, ids: list[int], params: l3.SamplingParams, index: int,
                  arrival: float, priority: int, array: np.ndarray | None = None) -> Sequence:
        seq = Sequence(next(self._seq_ids), rid, ids, params, index=index,
                       generator=self._generator_for(params, index), decoder=self._decoder(),
                       eos_token_ids=self.model.eos_token_ids, arrival_time=arrival,
                       priority=priority, prompt_array=array)
        if params.structured_outputs is not None:  # its grammar compiles from now on
            seq.grammar = self.grammars.state(params.structured_outputs)
        return seq

    def _generator_for(self, params: l3.SamplingParams, index: int) -> torch.Generator | None:
        """A completion's generator; None for a greedy one without speculation, which draws
        nothing (a CUDA generator seeded from the OS is ~20 us of a lone prompt's intake; a
        speculator's rows draw uniforms for every row of a mixed batch)."""
        if params.greedy and self.speculator is None:
            return None
        return self._generator(params, index)

    def _generator(self, params: l3.SamplingParams, index: int) -> torch.Generator:
        """Completion `index` of a seeded request draws from seed + index: reproducible, and
        the n completions differ."""
        seeded = params if params.seed is None else l3.SamplingParams(seed=params.seed + index)
        return l3.make_generator(seeded, self.model.device)

    def _decoder(self) -> l3.IncrementalDecoder | None:
        return self.model.tokenizer.decoder() if self.model.tokenizer else None

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now (its blocks are freed); its output so far, finish reason "abort"."""
        if request_id not in self._requests:
            return None
        self._normalize_prompts(request_id)
        self.scheduler.abort(request_id)
        prompt, seqs = self._requests.pop(request_id)
        self._count_live(seqs[0].params, -1)
        for s in seqs:
            s.finish_reason = s.finish_reason or "abort"
        seqs[0].pending_forks = 0
        return RequestOutput.of(request_id, prompt, seqs, time.perf_counter(), last=True)

    def _fork(self, parent: ScheduledSeq, out: SchedulerOutput) -> list[Sequence]:
        p = parent.seq
        children = [p.fork(next(self._seq_ids), i, self._generator_for(p.params, i),
                           self._decoder())
                    for i in range(1, p.params.n)]
        self.scheduler.fork(parent, children, out)
        self._requests[p.request_id][1].extend(children)
        return children

    def _outputs(self, request_ids: set[str], unfinished: bool, now: float,
                 delta: bool = False) -> list[RequestOutput]:
        """The outputs of request_ids in arrival order (unfinished=False: of the finished ones
        only; building an output copies every token list, so only if asked)."""
        reqs = self._requests
        if not request_ids:
            return []
        if self._unnormalized:  # (no launch since they came: a request's output has ints)
            self._normalize_prompts()
        # _requests is in arrival order, which is the order of its requests' first sequence
        # ids: when the step advanced most live requests (layer 6 asks for every running
        # request every step), keep that order instead of sorting
        if len(request_ids) * 4 >= len(reqs):
            rids = [rid for rid in reqs if rid in request_ids]
        else:
            rids = sorted([rid for rid in request_ids if rid in reqs],
                          key=lambda rid: reqs[rid][1][0].seq_id)
        outs = []
        for rid in rids:
            prompt, seqs = reqs[rid]
            if not unfinished and not (seqs[0].pending_forks == 0
                                       and all(s.finish_reason is not None for s in seqs)):
                continue
            o = RequestOutput.of(rid, prompt, seqs, now, delta=delta, last=True)
            if o.finished:
                # freed after the next launch (engine.py), not in the runner's next step
                # inputs, where their last references (the block-table mirror's) would go:
                # a 2k-token prompt's lists and ints take ~15 us to free
                self._retired.append(reqs[rid])
                del reqs[rid]
                self._count_live(seqs[0].params, -1)
                self._count_finished(o)
            outs.append(o)
        return outs
