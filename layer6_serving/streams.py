"""What a request's stream carries, and how engine outputs become deltas.

The engine (layer 4) keeps, per completion, the token ids and the text so far: its
incremental detokenizer (layer 3's IncrementalDecoder) never produces half a multi-byte
character, and its finish rule cuts the text at a stop string once one is complete. What it
cannot know is which text is safe to *send*: "ROMEO" might be the start of the stop string
"ROMEO." and must not reach the client until the next token shows it is not. `safe_length`
is that hold-back rule; `DeltaTracker` turns successive RequestOutputs into the new part of
each completion (token ids, text, logprobs) and the finish reason, once.
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


def safe_length(text: str, stops: tuple[str, ...]) -> int:
    """How much of `text` may be sent now: all of it minus the longest suffix that is a
    proper prefix of a stop string (a stop string that completes later would start there).
    A complete stop string never remains: the engine cuts the text at it."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return len(text) - hold


class DeltaTracker:
    """Per request: what was already sent of each completion. `update(output, logprobs)`
    returns the deltas since the last call (engine thread only)."""

    def __init__(self, stops: tuple[str, ...], want_logprobs: bool) -> None:
        self.stops, self.want_logprobs = stops, want_logprobs
        self.sent_tokens: dict[int, int] = {}
        self.sent_text: dict[int, int] = {}
        self.done: set[int] = set()

    def update(self, outputs, logprobs_of: dict[int, list[TokenLogprob]] | None = None) -> list[Delta]:
        """outputs: layer 4's CompletionOutputs; logprobs_of: completion index -> logprobs of
        its sampled tokens, in order (may run one past token_ids: a sampled EOS)."""
        deltas = []
        for c in outputs:
            if c.index in self.done:
                continue
            n_tok, n_txt = self.sent_tokens.get(c.index, 0), self.sent_text.get(c.index, 0)
            finished = c.finish_reason is not None
            end = len(c.text) if finished else safe_length(c.text, self.stops)
            ids, text = list(c.token_ids[n_tok:]), c.text[n_txt:max(end, n_txt)]
            if not ids and not text and not finished:
                continue
            lps = None
            if self.want_logprobs:
                got = (logprobs_of or {}).get(c.index, [])
                lps = [got[i] if i < len(got) else None for i in range(n_tok, len(c.token_ids))]
            reason = FINISH_REASONS.get(c.finish_reason, c.finish_reason) if finished else None
            deltas.append(Delta(c.index, ids, text, lps, reason))
            self.sent_tokens[c.index], self.sent_text[c.index] = len(c.token_ids), max(end, n_txt)
            if finished:
                self.done.add(c.index)
        return deltas
