"""What one step runs: `SchedulerOutput` (the scheduled sequences, copy-on-write block copies
to make first, the sequences preempted) and `ScheduledSeq` (one sequence's share of it),
made by the scheduler and read by the model runner, the speculator and the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: it computes tokens token_ids[context_len : context_len +
    num_new_tokens], followed by spec_token_ids (draft tokens a speculator filled in, at most
    num_lookahead, whose slots are reserved)."""

    seq: Sequence
    num_new_tokens: int
    context_len: int
    num_lookahead: int = 0
    # a list once a speculator fills it in; the empty tuple until then (one of these is made
    # per sequence per step: no new empty list each time)
    spec_token_ids: list[int] | tuple[()] = ()
    # >= 0: the one input token is still on the device, row `pending` of the previous step's
    # sampled tokens (async scheduling); -1: every input token is on the host
    pending: int = -1

    @property
    def query_len(self) -> int:
        return self.num_new_tokens + len(self.spec_token_ids)

    @property
    def input_ids(self) -> list[int]:
        end = self.context_len + self.num_new_tokens
        return self.seq.token_ids[self.context_len:end] + list(self.spec_token_ids)

    @property
    def samples(self) -> bool:
        """True when the step reaches the sequence's end, so its next token is sampled (a
        partial prefill chunk produces no token)."""
        return self.context_len + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # copy-on-write (src, dst) before the step
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # how many of `scheduled` the scheduler made as plain decodes: one token, the sequence's
    # last (so it samples), no lookahead, its slot in its own last block (no block allocated
    # or copied). All of them: a decode step that changed no block table, which the model
    # runner's decode inputs then take as such (decode_inputs.py)
    plain_decodes: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_lookahead for s in self.scheduled)
