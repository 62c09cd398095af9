"""Logits processing before sampling: presence/frequency penalties and logprobs.

The runner's plain sampler (argmax, or layer 3's `sample`) sees only the step's logits. Two
OpenAI features need more, and only for the requests that ask (SamplingParams
`needs_logits_processing`), so the all-greedy fast path is not touched otherwise:

  penalties   logits[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0)
              count(t): how often t occurs in the completion's generated tokens so far (the
              prompt does not count, as in OpenAI's API). Applied to the raw logits, before
              temperature / top-k / top-p.
  logprobs    log_softmax of the logits the sampler draws from (penalties applied, before
              temperature and top-k / top-p, as vLLM reports them): the chosen token's
              logprob and the top `logprobs` alternatives.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import layer3_model as l3


@dataclass
class TokenLogprobs:
    """One generated token's log-probability and the most likely alternatives, best first:
    top = [(token id, logprob), ...] (k of them, k = SamplingParams.logprobs)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def apply_penalties(logits: torch.Tensor, params: Sequence[l3.SamplingParams],
                    output_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """logits (N, V) -> a penalized copy (the input untouched: rows may view the step's
    logits); row i uses params[i] and output_ids[i] (the completion's generated tokens)."""
    if len(params) != logits.shape[0] or len(output_ids) != logits.shape[0]:
        raise ValueError(f"need one SamplingParams and one output-id list per logits row; got "
                         f"{tuple(logits.shape)}, {len(params)} params, {len(output_ids)} lists")
    rows = [i for i, p in enumerate(params)
            if (p.presence_penalty or p.frequency_penalty) and output_ids[i]]
    if not rows:
        return logits
    x, vocab = logits.clone(), logits.shape[-1]
    for i in rows:
        ids = torch.as_tensor(list(output_ids[i]), dtype=torch.int64, device=x.device)
        counts = torch.bincount(ids, minlength=vocab)[:vocab].to(x.dtype)  # (V,)
        p = params[i]
        x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)
    return x


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int],
                   ks: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """logits (N, V), the sampled tokens (N,), ks[i]: top-k count for row i (None: row i asked
    for no logprobs). One host transfer for the whole batch."""
    want = [i for i, k in enumerate(ks) if k is not None]
    out: list[TokenLogprobs | None] = [None] * len(ks)
    if not want:
        return out
    idx = torch.tensor(want, dtype=torch.int64, device=logits.device)
    lp = torch.log_softmax(logits[idx].float(), dim=-1)  # (W, V)
    chosen = lp.gather(1, torch.tensor([[tokens[i]] for i in want], device=lp.device))
    k_max = min(max(ks[i] for i in want), lp.shape[-1])
    vals, ids = lp.topk(k_max, dim=-1) if k_max else (lp[:, :0], lp[:, :0].long())
    chosen, vals, ids = chosen[:, 0].tolist(), vals.tolist(), ids.tolist()
    for j, i in enumerate(want):
        top = list(zip(ids[j][:ks[i]], vals[j][:ks[i]], strict=True))
        out[i] = TokenLogprobs(int(tokens[i]), chosen[j], top)
    return out


def sample_processed(sample, logits: torch.Tensor, params: Sequence[l3.SamplingParams],
                     generators: Sequence[torch.Generator | None],
                     output_ids: Sequence[Sequence[int]]
                     ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Penalties, then `sample(logits, params, generators)` (the runner's plain sampler), then
    logprobs of the sampled tokens: (tokens, one TokenLogprobs or None per row)."""
    x = logits if isinstance(logits, torch.Tensor) else torch.stack(list(logits))
    x = apply_penalties(x, params, output_ids)
    tokens = sample(x, params, generators)
    return tokens, token_logprobs(x, tokens, [p.logprobs for p in params])
