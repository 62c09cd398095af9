"""Speculative decoding inside the engine's step (paged cache, continuous batching).

The scheduler reserves `num_lookahead` slots for each decoding sequence (`ScheduledSeq`);
the step then goes

    speculator.propose(out)                  fills s.spec_token_ids (<= s.num_lookahead guesses)
    logits = runner.execute(out)             per sequence (1 + len(spec_token_ids), V) rows
    sampled = speculator.verify([(s, rows) for the sequences with spec_token_ids])
                                             seq_id -> accepted guesses + 1 token
    ... the engine samples the sequences that did not speculate, as usual ...
    scheduler.postprocess(out, sampled)      num_computed += accepted; block_manager.truncate()

and the scheduler's `on_release` hook (given at construction) frees a finished or preempted
sequence's draft state. Everything here only reads the duck-typed fields of core's
`ScheduledSeq` (num_lookahead, spec_token_ids, seq.token_ids / row / params / generator /
seq_id), so the engine's modules and these evolve independently.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

import layer3_model as l3

from ..config import EngineConfig
from .proposal import Proposal
from .proposers import DraftModelProposer, NgramProposer, Proposer
from .sampling import accept_proposals


@dataclass
class SpecCounts:
    """Speculation counted once, where tokens are verified: draft tokens proposed and
    accepted, and rounds (one verify of one sequence). LLM.stats reads these."""

    proposed: int = 0
    accepted: int = 0
    rounds: int = 0

    def record(self, proposed: int, accepted: int, rounds: int = 1) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.rounds += rounds

    def as_dict(self) -> dict:
        p, a, r = self.proposed, self.accepted, self.rounds
        return {"spec_proposed": p, "spec_accepted": a, "spec_rounds": r,
                "spec_acceptance_rate": a / p if p else 0.0,
                "spec_tokens_per_round": (a + r) / r if r else 0.0}


class Speculator(Protocol):
    """What the engine's step calls (EngineSpeculator is the built-in one). items of verify:
    (ScheduledSeq, its logits rows); release(seq): the Sequence gave up its row."""

    num_lookahead_slots: int
    counts: SpecCounts

    def propose(self, out) -> None: ...

    def verify(self, items: list[tuple]) -> dict[int, list[int]]: ...

    def release(self, seq) -> None: ...


class EngineSpeculator:
    """Proposes for the scheduled decodes and accepts against the target's logits.
    Counts proposed / accepted tokens and verify rounds in `counts` (`stats()`: as a dict)."""

    def __init__(self, proposer: Proposer, k: int) -> None:
        self.proposer, self.k = proposer, k
        self.counts = SpecCounts()
        self._pending: dict[int, tuple[Proposal, int]] = {}  # seq_id -> (proposal, its row)

    @classmethod
    def from_config(cls, config: EngineConfig, target: l3.Model) -> EngineSpeculator:
        """The speculator config.speculative describes, for `target` (the engine's model:
        its vocabulary, device and dtype). A draft model loads onto the target's device and
        dtype; its own contiguous KV cache has config.max_num_seqs rows of
        config.max_model_len slots (tiny for a small draft)."""
        spec = config.speculative
        if spec is None:
            raise ValueError("config.speculative is None: nothing to speculate with")
        if spec.method == "ngram":
            return cls(NgramProposer(*spec.ngram), spec.k)
        draft = l3.load(spec.draft or l3.course_model_dir("draft"), device=target.device,
                        dtype=target.net.dtype)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size}) differs from "
                             f"the target's ({target.config.vocab_size}): they must share a "
                             f"tokenizer")
        proposer = DraftModelProposer(draft.net, config.max_num_seqs,
                                      config.resolved_max_model_len, stop_below=spec.stop_below)
        return cls(proposer, spec.k)

    @property
    def num_lookahead_slots(self) -> int:
        """What the scheduler should reserve per decoding sequence."""
        return self.k

    def propose(self, out) -> None:
        """Fill spec_token_ids of every scheduled sequence that has lookahead slots
        (out: a SchedulerOutput, or its list of ScheduledSeq)."""
        self._pending.clear()
        scheduled = getattr(out, "scheduled", out)
        todo = [s for s in scheduled if s.num_lookahead > 0 and not s.seq.is_finished]
        if not todo:
            return
        seqs = [s.seq for s in todo]
        proposal = self.proposer.propose([q.token_ids for q in seqs], [q.row for q in seqs],
                                         [s.num_lookahead for s in todo],
                                         [q.params for q in seqs], [q.generator for q in seqs])
        for b, (s, n) in enumerate(zip(todo, proposal.num_tokens.tolist(), strict=True)):
            s.spec_token_ids = proposal.tokens[b, :n].tolist()
            if n:
                self._pending[s.seq.seq_id] = (proposal, b)

    def verify(self, items: Sequence[tuple]) -> dict[int, list[int]]:
        """items: (ScheduledSeq, its logits rows (1 + len(spec_token_ids), V)) for the sequences
        that speculated this step. Returns seq_id -> tokens to append (accepted guesses, then
        the correction or bonus token); EOS / stop / max_tokens may still cut them."""
        items = [(s, rows) for s, rows in items
                 if s.spec_token_ids and s.seq.seq_id in self._pending]
        if not items:
            return {}
        K = max(len(s.spec_token_ids) for s, _ in items)
        proposal = self._pending[items[0][0].seq.seq_id][0]  # one proposal per step
        V, dev = items[0][1].shape[-1], items[0][1].device
        target = torch.empty(len(items), K + 1, V, dtype=torch.float32, device=dev)
        draft_tokens = torch.zeros(len(items), K, dtype=torch.int64, device=dev)
        probs = None if proposal.probs is None else torch.zeros(len(items), K, V, device=dev)
        for j, (s, rows) in enumerate(items):
            n = len(s.spec_token_ids)
            target[j, : n + 1] = rows
            target[j, n + 1:] = rows[-1]  # never read: acceptance stops at n
            draft_tokens[j, :n] = torch.tensor(s.spec_token_ids, device=dev)
            if probs is not None:
                b = self._pending[s.seq.seq_id][1]
                probs[j, :n] = proposal.probs[b, :n].to(dev)
        num = torch.tensor([len(s.spec_token_ids) for s, _ in items], device=dev)
        seqs = [s.seq for s, _ in items]
        acc = accept_proposals(target, draft_tokens, num, probs, [q.params for q in seqs],
                               [q.generator for q in seqs])
        self.counts.record(int(num.sum()), int(acc.num_accepted.sum()), len(items))
        self._pending.clear()
        return {q.seq_id: toks for q, toks in zip(seqs, acc.emitted(), strict=True)}

    def release(self, seq) -> None:
        """Scheduler hook: the sequence gave up its row (finished, aborted or preempted)."""
        if seq.row is not None:
            self.proposer.release(seq.row)

    def stats(self) -> dict:
        return self.counts.as_dict()
