"""Choosing the next token from logits: greedy, temperature, top-k, top-p (vLLM's SamplingParams).

Order of operations for one row of logits (V,):
  temperature == 0  -> argmax (greedy; top_k, top_p and seed are irrelevant)
  logits / temperature                    (< 1 sharpens the distribution, > 1 flattens it)
  top-k: keep the k largest logits        (others -> -inf)
  top-p: keep the smallest set of most likely tokens whose probability sums to >= p
  sample from softmax(kept logits) with the request's own seeded torch.Generator
Each request owns its generator, so a seeded request draws the same tokens whatever
else shares its batch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20  # top alternatives a request may ask for (OpenAI's limit)


@dataclass(frozen=True)
class SamplingParams:
    """temperature >= 0 (0: greedy); top_k >= 0 (0 or -1: off); 0 < top_p <= 1 (1: off);
    seed: None draws a fresh one; max_tokens >= 1 new tokens at most; stop: strings that end
    the output (not included in it); ignore_eos: keep going past the EOS token; n: how many
    completions to sample from one prompt (parallel sampling, layer 4's engine: completion i
    is seeded with seed + i; layer 3's generate makes one completion and refuses n > 1).
    Layer 4's engine only (`needs_logits_processing`): presence_penalty / frequency_penalty
    in [-2, 2] (OpenAI's: logits[t] -= frequency * count(t) + presence * (count(t) > 0) over
    the completion's generated tokens); logprobs: None (off) or k >= 0 (report the sampled
    token's log-probability and the k most likely tokens', k <= MAX_LOGPROBS).
    structured_outputs: None, or what the output must match (a JSON schema, a regex, ...:
    StructuredOutputsParams; layer 4 masks the logits with its grammar)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default=())
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # a single string is a common slip: accept it as one stop
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        problems = []
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            problems.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            problems.append(f"top_k must be an int >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            problems.append(f"seed must be a non-negative int or None, got {self.seed!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            problems.append(f"n must be an int >= 1, got {self.n!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            problems.append(f"stop must be non-empty strings, got {self.stop!r}")
        problems += self._processing_problems()
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            problems.append(f"structured_outputs must be a StructuredOutputsParams, got {so!r}")
        if problems:
            raise ValueError("bad SamplingParams: " + "; ".join(problems))

    def _processing_problems(self) -> list[str]:
        problems = []
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and -2 <= v <= 2):
                problems.append(f"{name} must be a number in [-2, 2], got {v!r}")
        k = self.logprobs
        if k is not None and (not isinstance(k, int) or isinstance(k, bool)
                              or not 0 <= k <= MAX_LOGPROBS):
            problems.append(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {k!r}")
        return problems

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_logits_processing(self) -> bool:
        """True when sampling must look past the argmax / sampler: penalties or logprobs."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.logprobs is not None


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits (..., V) with everything below the k-th largest set to -inf (ties kept)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """logits (..., V) keeping the smallest most-likely set with probability mass >= p
    (the nucleus); the most likely token is always kept."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    drop_sorted = mass_before >= p  # already reached p without this token
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """The request's own random stream: seeded when params.seed is set."""
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """logits (B, V) -> next token ids (B,) int64, row b drawn with params[b] and generators[b]."""
    return _draw(logits, params, generators, guard=False)[0]


def sample_guarded(logits: torch.Tensor, params: Sequence[SamplingParams],
                   generators: Sequence[torch.Generator | None]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) -> (tokens (B,) int64, bad (B,) bool), drawn as `sample` draws them (same
    filters, same generator calls: seeded results are unchanged). bad[b]: row b's
    probabilities were not a distribution (nan, inf, or no token left); it drew from a
    harmless stand-in instead of raising, so one bad row cannot fail the batch, and its token
    is meaningless. No host sync: the flags stay on the device."""
    return _draw(logits, params, generators, guard=True)


def _draw(logits: torch.Tensor, params: Sequence[SamplingParams],
          generators: Sequence[torch.Generator | None], guard: bool
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"need logits (B, V) with one SamplingParams and generator per row; "
                         f"got {tuple(logits.shape)}, {len(params)} params, "
                         f"{len(generators)} generators")
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    ok = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device) if guard else None
    for b, (row, sp, gen) in enumerate(zip(logits.float(), params, generators, strict=True)):
        if sp.greedy:
            out[b] = row.argmax()
            continue
        row = top_p_filter(top_k_filter(row / sp.temperature, sp.top_k), sp.top_p)
        probs = torch.softmax(row, dim=-1)
        if guard:
            good = torch.isfinite(probs).all() & (probs.sum() > 0.5)
            probs = torch.where(good, probs, torch.ones_like(probs))  # a stand-in: always valid
            ok[b] = good
        out[b] = torch.multinomial(probs, 1, generator=gen)[0]
    return out, None if ok is None else ~ok
