"""Sampling that one request cannot break for the others.

A step samples every running sequence at once, so a row whose numbers go bad (a temperature
so small that logits / T overflows to inf, a top-p so small that it drops every token, or a
model that produced nan) must not take the batch down: `torch.multinomial` raises on such a
row (on a GPU it may even assert on the device), and the exception would end every request
in the step. Two defences:

  normalize   a temperature or top-p below GREEDY_EPS means "the most likely token": the
              request is greedy (temperature 0), which is what it asked for, exactly.
  guard       every sampled row's probabilities are checked on the device; a bad row draws
              from a harmless stand-in distribution (its token is discarded) and is flagged.
              The engine finishes a flagged request with finish_reason "error"; the others
              keep their tokens from the same step. No host sync is added: the flags travel
              with the tokens.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

import layer3_model as l3

GREEDY_EPS = 1e-5  # temperature / top_p below this: greedy (logits / T stays finite in fp32)


def normalize(params: l3.SamplingParams) -> l3.SamplingParams:
    """params, with a vanishing temperature or top-p turned into plain greedy (temperature 0)."""
    if params.temperature != 0 and (params.temperature < GREEDY_EPS or params.top_p < GREEDY_EPS):
        return dataclasses.replace(params, temperature=0.0)
    return params


def sample_guarded(logits: torch.Tensor, params: Sequence[l3.SamplingParams],
                   generators: Sequence[torch.Generator | None]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) -> (tokens (B,) int64, bad (B,) bool), row b drawn as layer 3's `sample`
    draws it (same filters, same generator calls: seeded results are unchanged). bad[b]: row
    b's probabilities were not a distribution (nan, inf, or no token left); its token is
    meaningless."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"need logits (B, V) with one SamplingParams and generator per row; "
                         f"got {tuple(logits.shape)}, {len(params)} params, "
                         f"{len(generators)} generators")
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    ok = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    for b, (row, sp, gen) in enumerate(zip(logits.float(), params, generators, strict=True)):
        if sp.greedy:
            out[b] = row.argmax()
            continue
        row = l3.top_p_filter(l3.top_k_filter(row / sp.temperature, sp.top_k), sp.top_p)
        probs = torch.softmax(row, dim=-1)
        good = torch.isfinite(probs).all() & (probs.sum() > 0.5)
        probs = torch.where(good, probs, torch.ones_like(probs))  # a stand-in: always valid
        out[b] = torch.multinomial(probs, 1, generator=gen)[0]
        ok[b] = good
    return out, ~ok
