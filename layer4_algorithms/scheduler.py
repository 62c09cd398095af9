"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Every step (one forward pass) gets a token budget, max_num_batched_tokens, and at most
max_num_seqs sequences. `schedule()` fills it in FCFS order:

1. running sequences first, oldest first: a decoding sequence takes 1 token (+ k lookahead
   slots when speculative decoding reserves them), a sequence still prefilling takes the next
   chunk of its prompt (chunked prefill: a long prompt is spread over several steps, the
   decodes of others keep going beside it). If the block pool cannot hold a sequence's new
   tokens, the *newest* running sequence is preempted: its blocks are freed and it goes back
   to the front of the waiting queue, to be recomputed later (preemption by recomputation:
   re-running its prompt + output costs one prefill, no swap space; with prefix caching most
   of its blocks are often still cached). Never an out-of-memory crash.
2. then waiting sequences, in arrival order, while the budget, max_num_seqs and the free
   blocks allow (after cached prefix blocks are matched); the first that does not fit stops
   admission (FCFS: nobody overtakes it), and nothing is admitted in a step that preempted.

A scheduled sequence's num_computed_tokens is advanced at once (its KV will be computed by
the time anything reads it: the GPU runs steps in order). The engine runs the step and then
calls `postprocess` with the sampled tokens, which appends them, registers full blocks in
the prefix cache, and frees finished sequences. Under async scheduling (engine.py) the next
step is scheduled before that: a sequence whose sampled token is still on the device
(`num_pending`) decodes it next (ScheduledSeq.pending: where the runner finds it), and one
that this token brings to max_tokens is left out (it is finished, whatever the token).
Policy "static" is the baseline for benchmarks: a new batch of
up to max_num_seqs sequences is admitted only once the previous batch has entirely finished.
Policy "priority" (vLLM's convention: lower priority value = sooner) replaces arrival order by
(priority, arrival) everywhere: the waiting queue is kept in that order (a preempted sequence
goes back to its place in it), running sequences are served in it, and the preemption victim
is the last in it: the lowest-priority running sequence (the newest among equals).
"""
from __future__ import annotations

import bisect
import heapq
import time
from collections import deque
from collections.abc import Callable, Iterable

from .config import EngineConfig
from .kv import BlockManager
from .scheduler_output import ScheduledSeq, SchedulerOutput
from .sequence import Sequence, SequenceStatus


def priority_key(seq: Sequence) -> tuple[int, float, int]:
    """The "priority" policy's order: priority (lower first), then arrival, then id."""
    return (seq.priority, seq.arrival_time, seq.seq_id)


class Scheduler:
    """Queues and the step policy for `block_manager`'s pool, with the limits of `config`
    (max_num_seqs, max_num_batched_tokens, max_model_len: resolved, enable_chunked_prefill,
    scheduling). num_lookahead_slots: KV slots reserved per decoding sequence for a
    speculator; on_release: called with a sequence when it gives up its row."""

    def __init__(self, block_manager: BlockManager, config: EngineConfig, *,
                 num_lookahead_slots: int = 0,
                 on_release: Iterable[Callable[[Sequence], None]] = ()) -> None:
        if not isinstance(num_lookahead_slots, int) or num_lookahead_slots < 0:
            raise ValueError("num_lookahead_slots must be an int >= 0, got "
                             f"{num_lookahead_slots!r}")
        self.bm = block_manager
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.resolved_max_model_len
        self.chunked = config.enable_chunked_prefill
        self.policy = config.scheduling
        self.num_lookahead_slots = num_lookahead_slots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_rows = list(range(self.max_num_seqs))  # a heap: the lowest free row first
        self._static_slots = self.max_num_seqs
        self.num_preemptions = 0
        self._on_release = tuple(on_release)

    # ---- requests ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence; ValueError if it could never run (too long for the model, the
        block pool, or, without chunked prefill, the token budget)."""
        total, rid = seq.num_tokens + seq.params.max_tokens, seq.request_id
        if total > self.max_model_len:
            raise ValueError(f"request {rid}: {seq.num_tokens} prompt tokens + max_tokens "
                             f"{seq.params.max_tokens} = {total} exceeds max_model_len "
                             f"{self.max_model_len}")
        need = self.bm.blocks_for(total + self.num_lookahead_slots)
        if need > self.bm.num_blocks:
            raise ValueError(f"request {rid}: {total} tokens need {need} KV blocks of "
                             f"{self.bm.block_size}, the whole pool has {self.bm.num_blocks}: "
                             "give the cache a bigger budget or lower max_tokens")
        if seq.params.n > self.max_num_seqs:
            raise ValueError(f"request {rid}: n={seq.params.n} parallel samples exceed "
                             f"max_num_seqs {self.max_num_seqs}")
        if not self.chunked and seq.num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"request {rid}: a {seq.num_tokens}-token prompt does not fit the "
                             f"{self.max_num_batched_tokens}-token step budget and chunked "
                             "prefill is off")
        if self.policy == "priority":
            bisect.insort(self.waiting, seq, key=priority_key)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of the request with reason "abort"; returns them."""
        seqs = [s for s in (*self.waiting, *self.running) if s.request_id == request_id]
        for s in seqs:
            if s.status is SequenceStatus.WAITING:
                self.waiting.remove(s)
            s.finish_reason = "abort"
            self._finish(s)
        return seqs

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.policy == "priority":  # then running[-1], the victim, is the lowest priority
            self.running.sort(key=priority_key)
        lookahead = self.num_lookahead_slots
        scheduled = out.scheduled
        append = scheduled.append
        # (raw counts: a 1 is exact, a parked free only makes a count high: allocate_slots then)
        running, bs, refs = self.running, self.bm.block_size, self.bm.raw_ref_counts
        plain = 0
        # (a for loop over running is safe: preemption only removes from its end, and a
        # sequence that preempts itself ends the loop)
        for seq in running:
            if budget <= 0:
                break
            pending = seq.num_pending
            total = len(seq.token_ids) + pending  # its tokens, those still on the device too
            if pending and total >= seq.max_num_tokens:
                continue  # its token on the device finishes it (length, or EOS / stop)
            computed = seq.num_computed_tokens
            left = total - computed
            if left == 1 and not lookahead:
                # a plain decode whose slot is in its own last block already (most steps of
                # most sequences): allocate_slots would change nothing and copy nothing
                table = seq.block_table
                j = computed // bs
                if j < len(table) and refs[table[j]] == 1:
                    append(ScheduledSeq(seq, 1, computed, 0, (),
                                        seq.pending_index if pending else -1))
                    seq.num_computed_tokens = computed + 1
                    budget -= 1
                    plain += 1
                    continue
            n = left if left < budget else budget
            k = self._lookahead(seq, budget - n) if lookahead and left == 1 else 0
            copies = self.bm.allocate_slots(seq, n + k)
            if copies is None and k:  # no room to speculate: a plain step
                k = 0
                copies = self.bm.allocate_slots(seq, n)
            while copies is None:  # out of blocks: preempt the newest, possibly seq itself
                victim = running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
                copies = self.bm.allocate_slots(seq, n)
            if copies is None:
                break
            append(ScheduledSeq(seq, n, computed, k, (), seq.pending_index if pending else -1))
            seq.num_computed_tokens = computed + n
            if copies:
                out.copies += copies
            budget -= n + k
        out.plain_decodes = plain
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _lookahead(self, seq: Sequence, budget: int) -> int:
        """Speculative slots for a decoding sequence: no more than the budget, its remaining
        max_tokens (the last sampled token counts) and max_model_len allow."""
        left = min(seq.params.max_tokens - len(seq.output_ids), self.max_model_len - seq.num_tokens)
        return max(0, min(self.num_lookahead_slots, budget, left - 1))

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        if self.policy == "static" and not self.running:
            self._static_slots = self.max_num_seqs  # the previous batch is done: open the next
        if not self.waiting:
            return
        seats = len(self.running) + sum(s.pending_forks for s in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            want = 1 + seq.pending_forks
            if seats + want > self.max_num_seqs:
                break
            if self.policy == "static" and seq.num_preemptions == 0 and self._static_slots < want:
                break
            hits = self.bm.match_prefix(seq)
            remaining = seq.num_tokens - len(hits) * self.bm.block_size
            if not self.chunked and remaining > budget:
                break
            n = min(remaining, budget)
            if not self.bm.can_admit(seq, hits, n):
                break
            self.waiting.popleft()
            self.bm.admit(seq, hits)
            copies = self.bm.allocate_slots(seq, n)
            # a newly admitted sequence shares only full blocks: nothing to copy
            assert copies == []
            seq.status = SequenceStatus.RUNNING
            seq.row = heapq.heappop(self._free_rows)
            seq.first_scheduled_time = seq.first_scheduled_time or time.perf_counter()
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens))
            seq.num_computed_tokens += n
            budget -= n
            seats += want
            if self.policy == "static" and seq.num_preemptions == 0:
                self._static_slots -= want

    def fork(self, parent: ScheduledSeq, children: list[Sequence], out: SchedulerOutput) -> None:
        """Parallel sampling: children (made by parent.seq.fork) share parent's blocks, run
        right behind it, and take part in this step's postprocess as if they had run it."""
        at = self.running.index(parent.seq) + 1
        for child in children:
            self.bm.fork(parent.seq, child)
            child.row = heapq.heappop(self._free_rows)
            out.scheduled.append(ScheduledSeq(child, parent.num_new_tokens, parent.context_len))
        self.running[at:at] = children
        parent.seq.pending_forks = 0

    def postprocess(self, out: SchedulerOutput, sampled: dict[int, list[int]] | None,
                    in_order: list[int] | None = None) -> list[Sequence]:
        """After the step: append each sampled sequence's tokens (seq_id -> tokens: one, or
        accepted drafts + one with speculation; EOS, stop strings and max_tokens may cut
        them); free finished sequences, roll back rejected speculative slots, register newly
        full blocks. Returns the finished ones. Under async scheduling the next step is
        already scheduled: a sequence may have been preempted since (its token still counts)
        or may finish now although that step computes one more token for it (discarded).
        in_order (instead of sampled): one token for each of out.scheduled, in its order."""
        finished = []
        now = time.perf_counter()
        bs, caching, running = self.bm.block_size, self.bm.enable_prefix_caching, \
            SequenceStatus.RUNNING
        if in_order is not None:
            if len(in_order) != len(out.scheduled):
                raise ValueError(f"{len(in_order)} tokens for {len(out.scheduled)} sequences")
            pairs = zip(out.scheduled, in_order, strict=True)
        else:
            get = sampled.get
            pairs = ((s, get(s.seq.seq_id)) for s in out.scheduled)
        for s, tokens in pairs:
            seq = s.seq
            if in_order is not None:  # (an int: one token)
                if seq.status is not running or s.num_lookahead:
                    self._advance(s, [tokens], now, finished)
                    continue
                token = tokens
            elif (tokens is not None and len(tokens) == 1 and seq.status is running
                  and not s.num_lookahead):
                token = tokens[0]
            else:
                self._advance(s, tokens, now, finished)
                continue
            # decoding on (the common case): one token, at most a newly full block to commit
            if seq.append_token(token, now):
                finished.append(seq)
            elif caching:
                known = len(seq.block_hashes)
                if seq.num_computed_tokens // bs > known and len(seq.block_table) > known:
                    self.bm.commit(seq)
        self._finish_all(finished)
        return finished

    def _advance(self, s: ScheduledSeq, tokens: list[int] | None, now: float,
                 finished: list[Sequence]) -> None:
        """postprocess of one scheduled sequence off the common path: several tokens
        (speculation), none, lookahead slots, or no longer running."""
        seq = s.seq
        if seq.status is SequenceStatus.FINISHED:  # aborted since it was scheduled
            return
        if tokens:
            for j, t in enumerate(tokens):
                if seq.append_token(t, now):
                    break
                if j < len(tokens) - 1:  # an accepted draft: its k, v are valid
                    seq.num_computed_tokens += 1
        if seq.finish_reason is not None:
            finished.append(seq)
            return
        if seq.status is not SequenceStatus.RUNNING:  # preempted after this step was scheduled
            return
        if s.num_lookahead:
            self.bm.truncate(seq, seq.num_computed_tokens)  # drop slots of rejected drafts
        if self.bm.enable_prefix_caching:
            full = seq.num_computed_tokens // self.bm.block_size
            if full > len(seq.block_hashes) and len(seq.block_table) > len(seq.block_hashes):
                self.bm.commit(seq)

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        self.bm.free(seq)
        if seq.row is not None:
            for hook in self._on_release:
                hook(seq)
            heapq.heappush(self._free_rows, seq.row)
            seq.row = None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.policy == "priority":
            bisect.insort(self.waiting, seq, key=priority_key)
        else:
            self.waiting.appendleft(seq)

    def _finish_all(self, seqs: list[Sequence]) -> None:
        """_finish for each of seqs; running ones leave the running list in one pass (one
        removal each would rescan it once per sequence: many finish in the same step when
        their max_tokens are equal)."""
        if len(seqs) > 1 and all(q.status is SequenceStatus.RUNNING for q in seqs):
            gone = {id(q) for q in seqs}
            self.running[:] = [q for q in self.running if id(q) not in gone]
            for q in seqs:
                self._release(q)
                q.status = SequenceStatus.FINISHED
            return
        for q in seqs:
            self._finish(q)

    def _finish(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)  # preempted, then finished by a token still in flight
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
