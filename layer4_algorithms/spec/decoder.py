"""Speculative decoding: a cheap proposer guesses k tokens, the target checks them in one pass.

Decode at small batch is memory-bound: a step reads every weight to produce one token per
sequence, so feeding the target k+1 tokens costs little more than feeding it one. One round
for each sequence (prompt + output so far, the newest token `last` not yet in the target's
cache, which holds `cached` tokens):

    propose   x_1..x_k = proposer(sequence)               draft model (k steps) or n-gram lookup
    verify    logits = target([last, x_1..x_k])           query_len k+1 after `cached` cached tokens
    accept    n accepted, then one correction/bonus token  exact rejection sampling (sampling.py)
    rollback  cached += 1 + n                              k, v of rejected guesses are dropped

so every round emits between 1 and k+1 tokens, distributed exactly as the target alone would
produce them (identical tokens under greedy). Rollback on a contiguous cache is the length
alone: the rejected slots are overwritten by later writes. A paged cache must also free the
trailing blocks that hold only rejected slots (the block manager's `truncate`).

The round is built from functions an engine can call with its own (paged) cache:
`Proposer.propose` -> `verify_input_ids` -> model(ids, ctx, cache) -> `verify_logits` ->
`accept_proposals` -> roll back to `cached + 1 + num_accepted`. `SpeculativeDecoder` runs the
rounds for a batch over layer 3's ContiguousKVCache and counts acceptance;
`engine_hook.EngineSpeculator` runs the same functions inside `LLM`'s step over the paged cache.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from layer3_model import (
    ContiguousKVCache,
    GeneratingSequence,
    Generation,
    GenerationStats,
    Model,
    SamplingParams,
)

from .proposal import Proposal
from .proposers import DraftModelProposer, NgramProposer, NgramThenDraftProposer, Proposer
from .sampling import accept_proposals, verify_input_ids, verify_logits


@dataclass
class SpecStats(GenerationStats):
    """Counts and seconds of the last generate() call: layer 3's GenerationStats (sequences,
    tokens, prefill and decode seconds, decode tokens/s counted as layer 3 counts them) and
    speculation's own. A "round" is one verify pass for one sequence; `steps` counts
    batch-wide verify passes."""

    steps: int = 0
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens appended by verify rounds (after a sequence's end: not counted)
    draft_steps: int = 0  # the draft model's forward passes (0 for n-gram lookup)
    propose_s: float = 0.0  # of decode_s, the seconds spent proposing
    verify_s: float = 0.0  # of decode_s, the seconds of the target's verify passes

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_per_round(self) -> float:
        """Draft tokens accepted per sequence per verify pass (0..k)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def mean_tokens_per_round(self) -> float:
        """Tokens emitted per sequence per verify pass (1..k+1): the speed-up if proposing
        were free."""
        return self.emitted / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        props = ("acceptance_rate", "mean_accepted_per_round", "mean_tokens_per_round",
                 "decode_tokens_per_s")
        return asdict(self) | {p: getattr(self, p) for p in props}


class _Seq(GeneratingSequence):
    """One request as layer 3 generates it (its output, layer 3's FinishRule: EOS, stop
    strings, max_tokens) and `cached`: how many of its tokens the target's cache holds."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.cached = 0
        self.k: int | None = None  # this sequence's proposal length under adaptive k

    @property
    def tokens(self) -> list[int]:
        return self.out.prompt_ids + self.out.token_ids


class SpeculativeDecoder:
    """Batch speculative generation on top of a layer-3 Model.

    proposer: a layer-3 Model (the draft: same vocabulary), "ngram" (prompt lookup,
    NgramProposer(min_n, max_n)), or any Proposer. k: tokens proposed per round (at most).
    stop_below: a draft stops a sequence's proposal early once its guess had probability
    below this (DraftModelProposer's dynamic draft length); None: always k.
    ngram_first (with a draft): look the continuation up in the sequence first and run the
    draft only where the lookup finds nothing (NgramThenDraftProposer).
    adaptive_k: each sequence's k follows its measured acceptance, between 1 and k (the
    schedule of transformers' assisted generation): +1 after a round that accepted every
    guess, -1 after one that rejected any.
    lean_draft: the draft's single-token steps through LeanDecodeStep (and its CUDA graph);
    False: through layer 3's serving forward (the slower path, kept for comparison).
    `generate(prompts, params) -> list[Generation]`; `stats` (SpecStats) after each call.
    """

    def __init__(self, target: Model, proposer: Model | Proposer | str = "ngram", k: int = 4, *,
                 ngram: tuple[int, int] = (1, 4), stop_below: float | None = None,
                 ngram_first: bool = False, adaptive_k: bool = False,
                 lean_draft: bool = True) -> None:
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k (tokens proposed per round) must be an int >= 1, got {k!r}")
        self.target, self.k, self.stop_below = target, k, stop_below
        self.ngram_first, self.adaptive_k, self.lean_draft = ngram_first, adaptive_k, lean_draft
        self.draft: Model | None = None
        if isinstance(proposer, str):
            if proposer != "ngram":
                raise ValueError(f"unknown proposer {proposer!r}: pass 'ngram', a draft Model or a "
                                 "Proposer")
            proposer = NgramProposer(*ngram)
        elif isinstance(proposer, Model):
            if proposer.config.vocab_size != target.config.vocab_size:
                raise ValueError(f"the draft's vocabulary ({proposer.config.vocab_size}) differs "
                                 "from the "
                                 f"target's ({target.config.vocab_size}): they must share a "
                                 "tokenizer")
            self.draft, proposer = proposer, None
        if ngram_first and self.draft is None:
            raise ValueError("ngram_first needs a draft model to fall back on")
        self.proposer: Proposer | None = proposer
        self._draft_prop: DraftModelProposer | None = None
        self.stats = SpecStats()

    @torch.inference_mode()
    def generate(self, prompts,
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[Generation]:
        """Generate for each prompt (text or token ids); params one for all or one per prompt."""
        t = self.target
        seqs = t.prepare(prompts, params, _Seq)
        B = len(seqs)
        max_len = max(len(s.out.prompt_ids) + s.params.max_tokens for s in seqs)
        cache = ContiguousKVCache.for_model(t.config, B, max_len, dtype=t.net.dtype,
                                            device=t.device)
        proposer = self.proposer or self._draft_proposer(B, max_len)
        if self.ngram_first:
            proposer = NgramThenDraftProposer(proposer)
        self.stats = stats = SpecStats(sequences=B,
                                       prompt_tokens=sum(len(s.out.prompt_ids) for s in seqs))

        t0 = t.sync()
        t.prefill(seqs, cache)
        for s in seqs:
            s.cached = len(s.out.prompt_ids)
        t1 = t.sync()
        stats.prefill_s, stats.generated_tokens = t1 - t0, sum(len(s.out.token_ids) for s in seqs)

        while active := [s for s in seqs if not s.finished]:
            self._round(active, cache, proposer)
            for s in active:
                if s.finished:
                    proposer.release(s.index)
        stats.decode_s = t.sync() - t1
        stats.generated_tokens = sum(len(s.out.token_ids) for s in seqs)
        stats.draft_steps = getattr(proposer, "steps", 0)
        return [s.out for s in seqs]

    def _draft_proposer(self, batch: int, max_len: int) -> DraftModelProposer:
        """The draft's proposer for a call of `batch` rows x max_len: built (and its CUDA
        graphs captured) before timing starts, kept for the next call of the same shape with
        every row released (nothing of the last call's draft cache is reused)."""
        prop = self._draft_prop
        if prop is None or (len(prop.cached), prop.max_len) != (batch, max_len):
            prop = self._draft_prop = DraftModelProposer(
                self.draft.net, batch, max_len, stop_below=self.stop_below,
                cuda_graph=self.draft.device.type == "cuda", lean=self.lean_draft)
        for row in range(batch):
            prop.release(row)
        prop.steps = prop.graph_steps = prop.lean_steps = 0  # counts are per call
        return prop

    def _k(self, s: _Seq) -> int:
        """Tokens to propose for s this round: k, or its adapted k (starting at k)."""
        if not self.adaptive_k:
            return self.k
        if s.k is None:
            s.k = self.k
        return s.k

    def _round(self, active: list[_Seq], cache: ContiguousKVCache, proposer: Proposer) -> None:
        """propose -> verify -> accept -> roll back, for every active sequence at once."""
        t, stats = self.target, self.stats
        params = [s.params for s in active]
        gens = [s.gen for s in active]
        rows = [s.index for s in active]
        # never propose past max_tokens: n accepted + 1 emitted <= tokens still allowed
        ks = [min(self._k(s), s.params.max_tokens - len(s.out.token_ids) - 1) for s in active]
        t0 = time.perf_counter()
        proposal = proposer.propose([s.tokens for s in active], rows, ks, params, gens)
        proposal = Proposal(proposal.tokens.to(t.device, torch.int64),
                            proposal.num_tokens.to(t.device, torch.int64),
                            None if proposal.probs is None else proposal.probs.to(t.device))
        t1 = time.perf_counter()
        ids, query_lens = verify_input_ids([s.out.token_ids[-1] for s in active], proposal)
        ctx = cache.context(query_lens, [s.cached for s in active], rows=rows)
        logits = verify_logits(t.net(ids, ctx, cache), query_lens, proposal.k)
        acc = accept_proposals(logits, proposal.tokens, proposal.num_tokens, proposal.probs, params,
                               gens)
        stats.verify_s += time.perf_counter() - t1
        stats.propose_s += t1 - t0
        n_acc = acc.num_accepted.tolist()
        if self.adaptive_k:
            for s, n, kb in zip(active, n_acc, proposal.num_tokens.tolist(), strict=True):
                if kb > 0:  # a round that proposed nothing says nothing about acceptance
                    s.k = min(self.k, s.k + 1) if n == kb else max(1, s.k - 1)
        for s, emitted, n in zip(active, acc.emitted(), n_acc, strict=True):
            s.cached += 1 + n  # rollback: the rejected guesses' slots are simply overwritten later
            before = len(s.out.token_ids)
            for x in emitted:
                s.append(x)
                if s.finished:
                    break
            stats.emitted += len(s.out.token_ids) - before
        stats.steps += 1
        stats.rounds += len(active)
        stats.proposed += int(proposal.num_tokens.sum())
        stats.accepted += sum(n_acc)
