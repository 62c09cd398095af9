"""Presence/frequency penalties and logprobs, which layer 4's sampler does not have.

Layer 4's engine samples every step's tokens with one call, `runner.sample(logits, params,
generators)`, and has no logits-processor or logprobs hook. This module wraps that call on
one engine instance (nothing global is patched): before sampling it subtracts OpenAI's
penalties from the rows of requests that asked for them,

    logits[t] -= frequency_penalty * count(t in output) + presence_penalty * (count > 0)

and after sampling it records the sampled token's log-probability (log-softmax of the
penalized logits, before temperature / top-p, as vLLM reports by default) and the top k.
A row is matched to its sequence through the sequence's own torch.Generator (one per
sequence, by identity). Speculative steps verify drafts without this call: their tokens
get no logprobs and no penalties (the stream carries None for them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .streams import TokenLogprob


@dataclass(frozen=True)
class RequestOptions:
    """Per-request sampling extras: logprobs (None: off; k >= 0: the sampled token and its k
    most likely alternatives), presence/frequency penalties (OpenAI's, in [-2, 2])."""

    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def active(self) -> bool:
        return self.logprobs is not None or bool(self.presence_penalty or self.frequency_penalty)


class SamplerHook:
    """Installed on an engine (`llm.runner.sample`); used only from the engine's thread."""

    def __init__(self, llm, token_text) -> None:
        self.llm, self.token_text = llm, token_text
        self.options: dict[str, RequestOptions] = {}  # request id -> extras (active ones only)
        self.logprobs: dict[tuple[str, int], list[TokenLogprob]] = {}  # (request id, index)
        self._sample = llm.runner.sample
        llm.runner.sample = self.sample

    def add(self, request_id: str, options: RequestOptions) -> None:
        if options.active:
            self.options[request_id] = options

    def forget(self, request_id: str) -> None:
        self.options.pop(request_id, None)
        for key in [k for k in self.logprobs if k[0] == request_id]:
            del self.logprobs[key]

    def take(self, request_id: str) -> dict[int, list[TokenLogprob]]:
        """The logprobs recorded so far per completion index of a request."""
        return {k[1]: v for k, v in self.logprobs.items() if k[0] == request_id}

    def sample(self, logits, params, generators) -> list[int]:
        if not self.options:  # the common case: the engine's own sampler, untouched
            return self._sample(logits, params, generators)
        by_gen = {id(s.generator): s for s in self.llm.scheduler.running}
        rows = []
        for i, g in enumerate(generators):
            seq = by_gen.get(id(g))
            opts = self.options.get(seq.request_id) if seq is not None else None
            if opts is not None:
                rows.append((i, seq, opts))
        if not rows:
            return self._sample(logits, params, generators)
        x = logits if isinstance(logits, torch.Tensor) else torch.stack(list(logits))
        x = x.clone()  # rows may view the step's logits
        vocab = x.shape[-1]
        for i, seq, o in rows:
            if (o.presence_penalty or o.frequency_penalty) and seq.output_ids:
                ids = torch.tensor(seq.output_ids, device=x.device).clamp_(0, vocab - 1)
                counts = torch.bincount(ids, minlength=vocab).to(x.dtype)
                x[i] -= o.frequency_penalty * counts + o.presence_penalty * (counts > 0).to(x.dtype)
        tokens = self._sample(x, params, generators)
        for i, seq, o in rows:
            if o.logprobs is not None:
                self._record(seq, x[i], tokens[i], o.logprobs)
        return tokens

    def _record(self, seq, row: torch.Tensor, token: int, k: int) -> None:
        lp = torch.log_softmax(row.float(), dim=-1)
        top = []
        if k > 0:
            vals, idx = torch.topk(lp, min(k, lp.shape[-1]))
            top = [(int(t), self.token_text(int(t)), float(v))
                   for v, t in zip(vals, idx, strict=True)]
        entry = TokenLogprob(int(token), self.token_text(int(token)), float(lp[token]), top)
        self.logprobs.setdefault((seq.request_id, seq.index), []).append(entry)
