"""What a request's stream carries, and how engine outputs become deltas.

The engine (layer 4) keeps, per completion, the token ids and the text so far, finished by
layer 3's `FinishRule` (EOS, stop strings, max_tokens, detokenizer flush). Which text is
safe to *send* is the same rule's other half: while a completion runs, the end of its text
that could still grow into a stop string ("ROMEO" when "ROMEO." is a stop) is held back,
and the detokenizer never yields half a multi-byte character. Layer 4's `CompletionOutput.text`
is exactly the text the rule has released, so `DeltaTracker` sends what is new in it since
the last step (and the new token ids, and their logprobs when asked for): no second rule,
no second detokenization.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

# Layer 4's finish reasons -> OpenAI's ("eos" is a stop; "abort" is ours: the client left).
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


@dataclass
class TokenLogprob:
    """One sampled token's log-probability and the top alternatives (token id, text, logprob):
    layer 4's TokenLogprobs with the tokens' text."""

    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass
class Delta:
    """The new part of completion `index`: token ids, text (never a partial character nor a
    possible stop-string prefix), logprobs (one per token id when asked for), and
    finish_reason ("stop" | "length" | "abort") in the completion's last delta."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None


@dataclass
class RequestMetricsSummary:
    """What the chat page shows per request (the "llm_stack" field of a response)."""

    ttft_s: float | None
    tokens_per_s: float | None
    cached_prompt_tokens: int
    spec_acceptance: float | None
    e2e_s: float | None = None
    queue_s: float | None = None

    def as_dict(self) -> dict:
        return {"ttft_s": self.ttft_s, "tokens_per_s": self.tokens_per_s,
                "cached_prompt_tokens": self.cached_prompt_tokens,
                "spec_acceptance": self.spec_acceptance}


@dataclass
class StreamOutput:
    """One item of a request's async stream: the deltas of one engine step (completions that
    did not advance are left out), prompt/completion token counts so far, and, once
    `finished`, the request's metrics."""

    request_id: str
    deltas: list[Delta]
    finished: bool
    prompt_tokens: int
    completion_tokens: int
    metrics: RequestMetricsSummary | None = None


def pack(out: StreamOutput) -> tuple:
    """A StreamOutput as plain tuples: pickled 10x faster than the dataclasses (the engine
    process sends every request's output every step)."""
    return (out.request_id, [(d.index, d.token_ids, d.text, d.logprobs, d.finish_reason)
                             for d in out.deltas],
            out.finished, out.prompt_tokens, out.completion_tokens, out.metrics)


def unpack(t: tuple) -> StreamOutput:
    rid, deltas, finished, prompt_tokens, completion_tokens, metrics = t
    return StreamOutput(rid, [Delta(*d) for d in deltas], finished, prompt_tokens,
                        completion_tokens, metrics)


def merge(outs: list[StreamOutput]) -> StreamOutput:
    """Several consecutive StreamOutputs of one request as one: each completion's deltas
    joined (index order of first appearance), counts and metrics from the last. A client
    that reads slower than the engine steps gets what piled up in one piece, as vLLM's
    output collector does, so a slow reader costs one chunk per read, not one per step."""
    if len(outs) == 1:
        return outs[0]
    merged: dict[int, Delta] = {}
    for out in outs:
        for d in out.deltas:
            m = merged.get(d.index)
            if m is None:
                lps = None if d.logprobs is None else list(d.logprobs)
                merged[d.index] = Delta(d.index, list(d.token_ids), d.text, lps, d.finish_reason)
                continue
            m.token_ids += d.token_ids
            m.text += d.text
            if d.logprobs is not None and m.logprobs is not None:
                m.logprobs += d.logprobs
            m.finish_reason = d.finish_reason or m.finish_reason
    last = outs[-1]
    return StreamOutput(last.request_id, list(merged.values()), last.finished,
                        last.prompt_tokens, last.completion_tokens, last.metrics)


class _Slice(NamedTuple):  # the part of a CompletionOutput not sent yet
    index: int
    token_ids: list[int]
    text: str
    logprobs: list | None
    finish_reason: str | None


class DeltaTracker:
    """Per request: how much of each completion was sent (token ids, characters of its text).
    `update(outputs)` returns the deltas since the last call (engine thread). token_text:
    token id -> its text, for the logprobs of completions that carry them."""

    def __init__(self, token_text: Callable[[int], str]) -> None:
        self.token_text = token_text
        self.sent_tokens: dict[int, int] = {}
        self.sent_chars: dict[int, int] = {}
        self.done: set[int] = set()

    def update(self, outputs, delta: bool = False) -> list[Delta]:
        """outputs: layer 4's CompletionOutputs (text: what the FinishRule released so far;
        logprobs: one per token id, or None when not asked for). delta: they are already
        deltas (LLM.step(delta=True): only what is new), taken as they are."""
        if not delta:
            outputs = [self._since_last(c) for c in outputs if c.index not in self.done]
        return [Delta(*d) for d in self.packed(outputs)[0]]

    def packed(self, outputs) -> tuple[list[tuple], int]:
        """update(outputs, delta=True) as plain tuples, pack()'s form of a Delta (what the
        engine process sends: no objects built per request per step only to be taken apart
        again for the pipe), and how many new token ids they hold."""
        deltas, new = [], 0
        for c in outputs:
            if c.index in self.done:
                continue
            ids, text, finished = c.token_ids, c.text, c.finish_reason is not None
            if not ids and not text and not finished:
                continue
            lps = None if c.logprobs is None else [self._logprob(lp) for lp in c.logprobs]
            reason = FINISH_REASONS.get(c.finish_reason, c.finish_reason) if finished else None
            deltas.append((c.index, ids, text, lps, reason))
            new += len(ids)
            if finished:
                self.done.add(c.index)
        return deltas, new

    def _since_last(self, c) -> _Slice:
        """A whole CompletionOutput -> what is new in it since the last call."""
        n_tok, n_chr = self.sent_tokens.get(c.index, 0), self.sent_chars.get(c.index, 0)
        self.sent_tokens[c.index], self.sent_chars[c.index] = len(c.token_ids), len(c.text)
        lps = None if c.logprobs is None else c.logprobs[n_tok:len(c.token_ids)]
        return _Slice(c.index, list(c.token_ids[n_tok:]), c.text[n_chr:], lps, c.finish_reason)

    def _logprob(self, lp) -> TokenLogprob:
        """Layer 4's TokenLogprobs (ids) -> ours (ids and their text)."""
        top = [(t, self.token_text(t), v) for t, v in lp.top]
        return TokenLogprob(lp.token_id, self.token_text(lp.token_id), lp.logprob, top)
