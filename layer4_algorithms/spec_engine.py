"""Speculative decoding inside the engine's step (paged cache, continuous batching).

The scheduler reserves `num_lookahead` slots for each decoding sequence (`ScheduledSeq`);
the step then goes

    speculator.propose(out)                  fills s.spec_token_ids (<= s.num_lookahead guesses)
    logits = runner.execute(out)             per sequence (1 + len(spec_token_ids), V) rows
    sampled = speculator.verify([(s, rows) for the sequences with spec_token_ids])
                                             seq_id -> accepted guesses + 1 token
    ... the engine samples the sequences that did not speculate, as usual ...
    scheduler.postprocess(out, sampled)      num_computed += accepted; block_manager.truncate()

and `scheduler.on_release.append(speculator.release)` frees a finished or preempted
sequence's draft state. Everything here only reads the duck-typed fields of core's
`ScheduledSeq` (num_lookahead, spec_token_ids, seq.token_ids / row / params / generator /
seq_id), so the engine's modules and these evolve independently.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from layer3_model import course_model_dir, load

from .proposers import DraftModelProposer, NgramProposer, Proposal, Proposer
from .spec_sampling import accept_proposals

METHODS = ("draft", "ngram")


@dataclass(frozen=True)
class SpecConfig:
    """method "draft" (a small model; `draft` = its checkpoint dir, default the course draft)
    or "ngram" (prompt lookup, n from ngram[1] down to ngram[0]); k guesses per step at most;
    stop_below: the draft's dynamic length (see DraftModelProposer)."""

    method: str = "draft"
    k: int = 4
    draft: str | Path | None = None
    ngram: tuple[int, int] = (1, 4)
    stop_below: float | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}: expected one of {', '.join(METHODS)}")
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"speculative k must be an int >= 1, got {self.k!r}")

    @classmethod
    def of(cls, spec: SpecConfig | dict | None) -> SpecConfig | None:
        return spec if spec is None or isinstance(spec, SpecConfig) else cls(**spec)


class EngineSpeculator:
    """Proposes for the scheduled decodes and accepts against the target's logits.
    Counts proposed / accepted tokens and verify rounds (`stats()`)."""

    def __init__(self, proposer: Proposer, k: int) -> None:
        self.proposer, self.k = proposer, k
        self.proposed = self.accepted = self.rounds = 0
        self._pending: dict[int, tuple[Proposal, int]] = {}  # seq_id -> (its step's proposal, row in it)

    @classmethod
    def for_engine(cls, llm, **config) -> EngineSpeculator:
        """`LLM(speculative=dict(method=..., k=..., draft=..., ngram=..., stop_below=...))`."""
        m = llm.model
        return cls.from_config(SpecConfig(**config), vocab_size=m.config.vocab_size,
                               max_num_seqs=llm.scheduler.max_num_seqs, max_model_len=llm.max_model_len,
                               device=m.device, dtype=m.net.dtype)

    @classmethod
    def from_config(cls, spec: SpecConfig | dict, *, vocab_size: int, max_num_seqs: int, max_model_len: int,
                    device: torch.device | str, dtype: torch.dtype | str | None = None) -> EngineSpeculator:
        """The draft loads onto the target's device and dtype; its own contiguous KV cache has
        max_num_seqs rows of max_model_len slots (tiny for a small draft)."""
        spec = SpecConfig.of(spec)
        if spec.method == "ngram":
            return cls(NgramProposer(*spec.ngram), spec.k)
        draft = load(spec.draft or course_model_dir("draft"), device=device, dtype=dtype)
        if draft.config.vocab_size != vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's "
                             f"({vocab_size}): they must share a tokenizer")
        return cls(DraftModelProposer(draft.net, max_num_seqs, max_model_len, stop_below=spec.stop_below), spec.k)

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
                                         [s.num_lookahead for s in todo], [q.params for q in seqs],
                                         [q.generator for q in seqs])
        for b, (s, n) in enumerate(zip(todo, proposal.num_tokens.tolist(), strict=True)):
            s.spec_token_ids = proposal.tokens[b, :n].tolist()
            if n:
                self._pending[s.seq.seq_id] = (proposal, b)

    def verify(self, items: Sequence[tuple]) -> dict[int, list[int]]:
        """items: (ScheduledSeq, its logits rows (1 + len(spec_token_ids), V)) for the sequences
        that speculated this step. Returns seq_id -> tokens to append (accepted guesses, then
        the correction or bonus token); EOS / stop / max_tokens may still cut them."""
        items = [(s, rows) for s, rows in items if s.spec_token_ids and s.seq.seq_id in self._pending]
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
        self.rounds += len(items)
        self.proposed += int(num.sum())
        self.accepted += int(acc.num_accepted.sum())
        self._pending.clear()
        return {q.seq_id: toks for q, toks in zip(seqs, acc.emitted(), strict=True)}

    def release(self, seq) -> None:
        """Scheduler hook: the sequence gave up its row (finished, aborted or preempted)."""
        if seq.row is not None:
            self.proposer.release(seq.row)

    def stats(self) -> dict:
        return {"spec_proposed": self.proposed, "spec_accepted": self.accepted, "spec_rounds": self.rounds,
                "spec_acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "spec_tokens_per_round": (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0}
