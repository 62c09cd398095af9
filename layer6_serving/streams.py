"""What a request's stream carries, and how engine outputs become deltas.

The engine (layer 4) keeps, per completion, the token ids and the text so far, finished by
layer 3's `FinishRule` (EOS, stop strings, max_tokens, detokenizer flush). Which text is
safe to *send* is the same rule's other half: while a completion runs, the end of its text
that could still grow into a stop string ("ROMEO" when "ROMEO." is a stop) is held back,
and the detokenizer never yields half a multi-byte character. The engine does not hand out
what its rule emitted, so `DeltaTracker` runs one `FinishRule` per completion over the token
ids the engine reports (the same rule on the same tokens: the same decisions) and sends
exactly the pieces it returns; a completion that ended with EOS gets the EOS fed to it so
its last (flushed) text comes out.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Layer 4's finish reasons -> OpenAI's ("eos" is a stop; "abort" is ours: the client left).
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


@dataclass
class TokenLogprob:
    """One sampled token's log-probability and the top alternatives (token id, text, logprob)."""

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


class DeltaTracker:
    """Per request: one FinishRule per completion, fed the engine's new token ids.
    `update(outputs, logprobs_of)` returns the deltas since the last call (engine thread)."""

    def __init__(self, params, eos_token_ids: tuple[int, ...], new_decoder, finish_rule,
                 want_logprobs: bool) -> None:
        self.params, self.eos, self.new_decoder = params, tuple(eos_token_ids), new_decoder
        self.finish_rule, self.want_logprobs = finish_rule, want_logprobs
        self.rules: dict = {}  # completion index -> FinishRule
        self.sent_tokens: dict[int, int] = {}
        self.done: set[int] = set()

    def _rule(self, index: int):
        if index not in self.rules:
            self.rules[index] = self.finish_rule(self.params, self.eos, self.new_decoder())
        return self.rules[index]

    def update(self, outputs, logprobs_of: dict[int, list[TokenLogprob]] | None = None
               ) -> list[Delta]:
        """outputs: layer 4's CompletionOutputs; logprobs_of: completion index -> logprobs of
        its sampled tokens, in order (may run one past token_ids: a sampled EOS)."""
        deltas = []
        for c in outputs:
            if c.index in self.done:
                continue
            rule, n_tok = self._rule(c.index), self.sent_tokens.get(c.index, 0)
            ids, text = list(c.token_ids[n_tok:]), ""
            for t in ids:
                if not rule.finished:
                    text += rule.append(t)[0]
            finished = c.finish_reason is not None
            if finished and c.finish_reason != "abort" and not rule.finished:
                if self.eos and not self.params.ignore_eos:
                    text += rule.append(self.eos[0])[0]  # EOS: flushes the detokenizer
                if not rule.finished:  # ended for a reason the rule cannot see: show the rest
                    text += rule.text[rule.emitted:]
            if not ids and not text and not finished:
                continue
            lps = None
            if self.want_logprobs:
                got = (logprobs_of or {}).get(c.index, [])
                lps = [got[i] if i < len(got) else None for i in range(n_tok, len(c.token_ids))]
            reason = FINISH_REASONS.get(c.finish_reason, c.finish_reason) if finished else None
            deltas.append(Delta(c.index, ids, text, lps, reason))
            self.sent_tokens[c.index] = len(c.token_ids)
            if finished:
                self.done.add(c.index)
        return deltas
