"""Sampling that one request cannot break for the others.

A step samples every running sequence at once, so a row whose numbers go bad (a temperature
so small that logits / T overflows to inf, a top-p so small that it drops every token, or a
model that produced nan) must not take the batch down: `torch.multinomial` raises on such a
row (on a GPU it may even assert on the device), and the exception would end every request
in the step. Two defences:

  normalize   a temperature or top-p below GREEDY_EPS means "the most likely token": the
              request is greedy (temperature 0), which is what it asked for, exactly.
  guard       every sampled row's probabilities are checked on the device (layer 3's
              sample_guarded, the same draw as `sample`); a bad row draws from a harmless
              stand-in distribution (its token is discarded) and is flagged.
              The engine finishes a flagged request with finish_reason "error"; the others
              keep their tokens from the same step. No host sync is added: the flags travel
              with the tokens.
"""
from __future__ import annotations

import dataclasses

import layer3_model as l3

GREEDY_EPS = 1e-5  # temperature / top_p below this: greedy (logits / T stays finite in fp32)


def normalize(params: l3.SamplingParams) -> l3.SamplingParams:
    """params, with a vanishing temperature or top-p turned into plain greedy (temperature 0)."""
    if params.temperature != 0 and (params.temperature < GREEDY_EPS or params.top_p < GREEDY_EPS):
        return dataclasses.replace(params, temperature=0.0)
    return params


sample_guarded = l3.sample_guarded  # the draw itself is layer 3's (one loop for both)
