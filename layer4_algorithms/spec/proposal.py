"""What a proposer hands the verifier: `Proposal` (its own module, so that the proposers and
the rejection sampler both import it and neither imports the other)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    """tokens (B, K) int64 (rows padded with 0 past num_tokens[b]); num_tokens (B,) int64;
    probs (B, K, V) fp32 processed draft distributions, or None when q is one-hot."""

    tokens: torch.Tensor
    num_tokens: torch.Tensor
    probs: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return int(self.tokens.shape[1])
