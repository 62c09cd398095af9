"""Speculative decoding: a cheap proposer guesses k tokens, the target checks them in one pass.

proposal.py (`Proposal`: what a proposer returns) <- sampling.py (exact rejection sampling,
the verify batch) <- proposers.py (`NgramProposer`, `DraftModelProposer`) <- decoder.py
(`SpeculativeDecoder` over layer 3's contiguous cache) and engine_hook.py (`EngineSpeculator`
inside LLM's step over the paged cache; the `Speculator` protocol; `SpecCounts`). Arrows point
at what a module imports; `layer4_algorithms.bench.speculative` measures the speed-up.
"""
from .decoder import SpecStats, SpeculativeDecoder
from .engine_hook import EngineSpeculator, SpecCounts, Speculator
from .proposal import Proposal
from .proposers import DraftModelProposer, NgramProposer, Proposer
from .sampling import (
    Acceptance,
    accept_proposals,
    greedy_accept,
    rejection_sample,
    verify_input_ids,
    verify_logits,
)

__all__ = [
    "Proposal", "Proposer", "NgramProposer", "DraftModelProposer",
    "accept_proposals", "rejection_sample", "greedy_accept", "Acceptance",
    "verify_input_ids", "verify_logits",
    "SpeculativeDecoder", "SpecStats", "EngineSpeculator", "SpecCounts", "Speculator",
]
