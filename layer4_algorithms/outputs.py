"""What the engine hands back: per-request outputs with timings, and engine-wide statistics.

Per request (vLLM's names): TTFT (time to first token: arrival -> first token sampled),
queue time (arrival -> first scheduled), TPOT (time per output token after the first:
(last token - first token) / (tokens - 1)), end-to-end latency. Times are perf_counter seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .logits_processing import TokenLogprobs
from .sequence import Sequence


@dataclass
class CompletionOutput:
    """One sampled completion: index among the request's n, token ids, text, finish reason
    ("eos", "stop", "length", "abort"; None while running), logprobs (one TokenLogprobs per
    token id when SamplingParams.logprobs is set, else None). text is what layer 3's
    FinishRule has released: while running, an end that may still grow into a stop string
    (or half a character) is held back, so a stream sends text[len(sent):] each step and
    never takes anything back; once finished it is the whole text (cut before a stop)."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    num_preemptions: int
    tpot: float | None  # mean over completions with >= 2 tokens
    spec_proposed: int = 0  # this request's draft tokens verified (speculative decoding)
    spec_accepted: int = 0  # ... and accepted

    @property
    def spec_acceptance(self) -> float | None:
        """This request's own acceptance rate (None: nothing was proposed for it)."""
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's state: prompt, completions (n of them once forked), finished, metrics."""

    request_id: str
    prompt: str | list[int] | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics

    @classmethod
    def of(cls, request_id: str, prompt, seqs: list[Sequence], now: float, *,
           delta: bool = False, last: bool = False) -> RequestOutput:
        """delta: each completion carries only what is new since its last delta output (token
        ids, released text, logprobs; vLLM's RequestOutputKind.DELTA), and prompt_token_ids
        only in the request's first one: no copy of what the caller already has. last: the
        caller is done with seqs once this output is finished (the engine retires them): a
        finished output then takes the prompt's id list itself, not a copy (a 2k-token
        prompt's copy is a pass over 2k objects while the caller waits for its output)."""
        if len(seqs) == 1:  # built for every running request every step (layer 6): no loops
            first = seqs[0]
            n_out = len(first.output_ids)
            finished = first.finish_reason is not None and first.pending_forks == 0
            metrics = RequestMetrics(
                first.arrival_time, first.first_scheduled_time, first.first_token_time,
                now if finished else None, len(first.prompt_ids), first.num_cached_tokens,
                first.num_preemptions,
                (first.last_token_time - first.first_token_time) / (n_out - 1)
                if n_out > 1 else None, first.spec_proposed, first.spec_accepted)
            if delta:
                prompt_ids = [] if first.delta_started else list(first.prompt_ids)
                first.delta_started = True
                return cls(request_id, prompt, prompt_ids, [_delta(first)], finished, metrics)
            prompt_ids = first.prompt_ids if last and finished else list(first.prompt_ids)
            return cls(request_id, prompt, prompt_ids, [_completion(first)], finished, metrics)
        seqs = sorted(seqs, key=lambda s: s.index)
        first = seqs[0]
        finished = first.pending_forks == 0  # one pass: counts, TPOTs, first token
        tpots, first_token, preemptions, proposed, accepted = [], None, 0, 0, 0
        for s in seqs:
            finished = finished and s.finish_reason is not None
            n_out = len(s.output_ids)
            if n_out > 1:
                tpots.append((s.last_token_time - s.first_token_time) / (n_out - 1))
            t = s.first_token_time
            if t is not None and (first_token is None or t < first_token):
                first_token = t
            preemptions += s.num_preemptions
            proposed += s.spec_proposed
            accepted += s.spec_accepted
        tpot = sum(tpots) / len(tpots) if tpots else None
        metrics = RequestMetrics(
            first.arrival_time, first.first_scheduled_time, first_token,
            now if finished else None, len(first.prompt_ids), first.num_cached_tokens,
            preemptions, tpot, proposed, accepted)
        if delta:
            outs = [_delta(s) for s in seqs]
            prompt_ids = [] if first.delta_started else list(first.prompt_ids)
            first.delta_started = True
            return cls(request_id, prompt, prompt_ids, outs, finished, metrics)
        prompt_ids = first.prompt_ids if last and finished else list(first.prompt_ids)
        return cls(request_id, prompt, prompt_ids, [_completion(s) for s in seqs], finished,
                   metrics)


def _completion(s: Sequence) -> CompletionOutput:
    """All of `s` so far (copies: the caller may keep it while `s` goes on)."""
    return CompletionOutput(s.index, list(s.output_ids), s.safe_text, s.finish_reason,
                            None if s.logprobs is None else s.logprobs[:len(s.output_ids)])


def _delta(s: Sequence) -> CompletionOutput:
    """What `s` gained since its last delta output; moves its cursors."""
    n_tok, end = len(s.output_ids), s.finish.emitted  # released text (all once finished)
    lps = None if s.logprobs is None else s.logprobs[s.delta_tokens:n_tok]
    out = CompletionOutput(s.index, s.output_ids[s.delta_tokens:],
                           s.finish.text[s.delta_chars:end], s.finish_reason, lps)
    s.delta_tokens, s.delta_chars = n_tok, end
    return out


@dataclass
class EngineStats:
    """Since the engine was built or stats were last reset (generate() resets them)."""

    steps: int = 0
    requests: int = 0  # finished requests
    prompt_tokens: int = 0  # of finished requests
    generated_tokens: int = 0  # output tokens of finished requests
    # tokens run through the model (prefill chunks, decodes, recomputation, drafts)
    batched_tokens: int = 0
    elapsed_s: float = 0.0  # wall time inside step()
    preemptions: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    spec_proposed: int = 0  # draft tokens verified (speculative decoding)
    spec_accepted: int = 0
    ttfts: list[float] = field(default_factory=list, repr=False)
    tpots: list[float] = field(default_factory=list, repr=False)

    @property
    def generated_tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        """(prompt + generated tokens of finished requests) per second."""
        total = self.prompt_tokens + self.generated_tokens
        return total / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        queried = self.prefix_queried_tokens
        return self.prefix_hit_tokens / queried if queried else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else None

    @property
    def mean_ttft(self) -> float | None:
        return sum(self.ttfts) / len(self.ttfts) if self.ttfts else None

    @property
    def mean_tpot(self) -> float | None:
        return sum(self.tpots) / len(self.tpots) if self.tpots else None

    def as_dict(self) -> dict:
        return {"steps": self.steps, "requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens, "batched_tokens": self.batched_tokens,
                "elapsed_s": self.elapsed_s, "generated_tokens_per_s": self.generated_tokens_per_s,
                "total_tokens_per_s": self.total_tokens_per_s, "preemptions": self.preemptions,
                "prefix_hit_rate": self.prefix_hit_rate,
                "prefix_hit_tokens": self.prefix_hit_tokens,
                "prefix_queried_tokens": self.prefix_queried_tokens,
                "acceptance_rate": self.acceptance_rate,
                "mean_ttft_s": self.mean_ttft, "mean_tpot_s": self.mean_tpot}


class ProgressBar:
    """A rich progress bar over finished requests with live throughput
    (LLM.generate(progress=True))."""

    def __init__(self, total: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.p = Progress(TextColumn("[bold]generate"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(),
                          TextColumn("{task.description}"), transient=True)
        self.task = self.p.add_task("", total=total)
        self.p.start()

    def update(self, done: int, stats: EngineStats) -> None:
        self.p.update(self.task, completed=done,
                      description=f"{stats.generated_tokens_per_s:,.0f} tok/s out, "
                                                            f"{stats.preemptions} preemptions")

    def close(self) -> None:
        self.p.stop()
