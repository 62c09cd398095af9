"""The engine's per-step sampling bookkeeping: which sampler a step's rows take, where the
logprobs go, and each sequence's speculative counts. (engine.py's `step` calls these.)"""
from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

import layer3_model as l3

from .model_runner import ModelRunner
from .scheduler import ScheduledSeq
from .sequence import Sequence
from .structured import TokenMasks, mask_rows


def check_params(params: l3.SamplingParams, speculating: bool) -> None:
    """ValueError for what the engine cannot honour: penalties or logprobs under speculative
    decoding (verification samples drafts without them: the counts and logprobs would lie)."""
    if speculating and params.needs_logits_processing:
        raise ValueError("presence_penalty, frequency_penalty and logprobs are not supported "
                         "with speculative decoding: build the engine without `speculative` "
                         "or leave them at their defaults")


def host_sampled(params: l3.SamplingParams) -> bool:
    """A request whose rows need the host between steps (penalties, logprobs): while one is
    live, the engine steps synchronously. (A grammar's mask needs only the previous token on
    the host, which async scheduling reads before it samples: engine.py.)"""
    return params.needs_logits_processing


def sample_rows(runner: ModelRunner, rows: torch.Tensor, seqs: Seq[Sequence],
                masks: TokenMasks | None = None) -> list[int]:
    """One token per row of rows (N, V), row i for seqs[i]. The plain sampler (one argmax for
    an all-greedy step) unless a row needs penalties or logprobs; those logprobs are appended
    to the sequence's `logprobs` (an EOS's too: outputs cut the list to the output tokens).
    Rows of constrained sequences (`seq.grammar`) are masked first (structured/; masks: the
    engine's reused buffers)."""
    mask_rows(rows, seqs, masks)
    params = [q.params for q in seqs]
    generators = [q.generator for q in seqs]
    if not any(p.needs_logits_processing for p in params):  # the fast path
        return runner.sample(rows, params, generators)
    tokens, lps = runner.sample_processed(rows, params, generators, [q.output_ids for q in seqs])
    for q, lp in zip(seqs, lps, strict=True):
        if lp is not None and q.logprobs is not None:
            q.logprobs.append(lp)
    return tokens


def count_speculation(items: Seq[tuple[ScheduledSeq, torch.Tensor]],
                      verified: dict[int, list[int]]) -> None:
    """Per sequence: drafts verified and accepted (the tokens to append are the accepted
    drafts + one), the same figures the speculator's SpecCounts sums over the engine."""
    for s, _ in items:
        tokens = verified.get(s.seq.seq_id)
        if tokens:
            s.seq.spec_proposed += len(s.spec_token_ids)
            s.seq.spec_accepted += len(tokens) - 1
