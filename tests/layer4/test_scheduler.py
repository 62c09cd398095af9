"""Scheduler behaviour with a fake model (tokens drawn at random, no tensors): budgets, chunked
prefill mixed with decodes, FCFS admission, preemption by recomputation, static batching,
lookahead slots, and a property test that no workload leaks a block."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layer4_algorithms import (
    BlockManager,
    EngineConfig,
    SamplingParams,
    Scheduler,
    Sequence,
    SequenceStatus,
)

EOS = 0


def make_scheduler(bm: BlockManager, *, num_lookahead_slots: int = 0, **config) -> Scheduler:
    return Scheduler(bm, EngineConfig(**config), num_lookahead_slots=num_lookahead_slots)


def make_seq(i: int, n_prompt: int, max_tokens: int, *, n: int = 1, vocab: int = 50, rng=None,
             prompt=None) -> Sequence:
    rng = rng or random.Random(i)
    prompt = prompt if prompt is not None else [rng.randrange(1, vocab) for _ in range(n_prompt)]
    return Sequence(i, str(i), prompt, SamplingParams(max_tokens=max_tokens, n=n),
                    eos_token_ids=(EOS,))


class FakeEngine:
    """Drives a scheduler the way LLM.step does, with random tokens instead of a model."""

    def __init__(self, sched: Scheduler, seed: int = 0, eos_prob: float = 0.0, accept=None,
                 in_order: bool = False) -> None:
        self.sched = sched
        self.in_order = in_order  # plain-decode steps' tokens given as a list in step order
        self.rng = random.Random(seed)
        self.eos_prob = eos_prob
        self.accept = accept
        self.next_id, self.finished, self.steps = 10_000, [], []

    def step(self):
        tables = {id(q): (q.block_table, len(q.block_table)) for q in self.sched.running}
        out = self.sched.schedule()
        self.steps.append(out)
        check_plain(out, tables)
        for s in out.scheduled:  # a speculator fills the reserved slots
            s.spec_token_ids = [self.rng.randrange(1, 50) for _ in range(s.num_lookahead)]
        sampled = {}
        for s in list(out.scheduled):
            if not s.samples:
                continue
            seqs = [s.seq]
            if s.seq.pending_forks:
                kids = [s.seq.fork(self.next_id + i, i + 1, None,
                                   None) for i in range(s.seq.pending_forks)]
                self.next_id += len(kids)
                self.sched.fork(s, kids, out)
                seqs += kids
            for q in seqs:
                tok = EOS if self.rng.random() < self.eos_prob else self.rng.randrange(1, 50)
                if s.spec_token_ids and q is s.seq:
                    j = self.accept
                    if j is None:
                        j = self.rng.randrange(len(s.spec_token_ids) + 1)
                    sampled[q.seq_id] = s.spec_token_ids[:j] + [tok]
                else:
                    sampled[q.seq_id] = [tok]
        if self.in_order and out.plain_decodes == len(out.scheduled) == len(sampled):
            tokens = [sampled[s.seq.seq_id][0] for s in out.scheduled]
            self.finished += self.sched.postprocess(out, None, in_order=tokens)
        else:
            self.finished += self.sched.postprocess(out, sampled)
        return out

    def run(self, max_steps: int = 10_000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            out = self.step()
            assert out.scheduled, "no progress"
            check_invariants(self.sched)
        raise AssertionError("did not finish")


def check_plain(out, tables: dict) -> None:
    """A step the scheduler says is all plain decodes: one token each, the sequence's last,
    no lookahead, and no block table replaced or grown by the scheduling (what the model
    runner's decode inputs take for granted)."""
    assert 0 <= out.plain_decodes <= len(out.scheduled)
    if out.scheduled and out.plain_decodes == len(out.scheduled):
        for s in out.scheduled:
            assert s.num_new_tokens == 1 and s.num_lookahead == 0 and s.samples
            table, n = tables[id(s.seq)]
            assert s.seq.block_table is table and len(table) == n


def check_invariants(sched: Scheduler) -> None:
    bm = sched.bm
    refs = [0] * bm.num_blocks
    for s in sched.running:
        assert s.status is SequenceStatus.RUNNING and s.row is not None
        assert len(s.block_table) >= bm.blocks_for(s.num_computed_tokens)
        for b in s.block_table:
            refs[b] += 1
    for s in sched.waiting:
        assert s.block_table == [] and s.num_computed_tokens == 0 and s.row is None
    assert refs == bm.ref_counts
    assert bm.num_free_blocks == sum(1 for r in refs if r == 0)
    rows = [s.row for s in sched.running]
    assert len(set(rows)) == len(rows) and all(0 <= r < sched.max_num_seqs for r in rows)


def test_decodes_and_a_prefill_chunk_share_a_step_within_the_token_budget():
    sched = make_scheduler(BlockManager(64, 4), max_num_batched_tokens=8, max_model_len=200)
    eng = FakeEngine(sched)
    for i in range(2):
        sched.add(make_seq(i, 3, 20))
    eng.step()  # both short prompts prefilled (6 tokens)
    sched.add(make_seq(2, 30, 5))
    out = eng.step()
    kinds = [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled]
    assert kinds == [(0, 1), (1, 1), (2, 6)]  # two decodes + a 6-token chunk = the budget of 8
    assert not out.scheduled[2].samples
    for _ in range(4):
        out = eng.step()
        assert out.num_batched_tokens <= 8
    assert sched.running[2].num_computed_tokens == 6 * 5  # 6 tokens per step while others decode


def test_sequences_finishing_in_one_step_all_leave_and_free_their_blocks():
    """Equal max_tokens finish together: they leave `running` at once (one pass), the others
    keep their order, and every block and row comes back."""
    bm = BlockManager(64, 4)
    sched = make_scheduler(bm, max_model_len=64)
    eng = FakeEngine(sched)
    seqs = [make_seq(i, 3 + i, 4 if i % 2 else 6) for i in range(6)]
    for q in seqs:
        sched.add(q)
    for _ in range(4):  # the prefill's token and three decodes: max_tokens=4 reached
        eng.step()
    assert [q.seq_id for q in sched.running] == [0, 2, 4]
    for q in seqs[1::2]:
        assert q.finish_reason == "length" and q.row is None and q.block_table == []
    check_invariants(sched)
    eng.run()
    assert bm.num_free_blocks == 64 and sorted(sched._free_rows) == list(range(sched.max_num_seqs))


def test_admission_is_first_come_first_served_and_respects_max_num_seqs():
    sched = make_scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100,
                           max_model_len=200)
    for i, n in enumerate([5, 40, 2]):
        sched.add(make_seq(i, n, 3))
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1]
    assert [s.seq_id for s in sched.waiting] == [2]


def test_a_request_that_does_not_fit_blocks_later_ones():
    sched = make_scheduler(BlockManager(6, 4), max_num_batched_tokens=100, max_model_len=200)
    sched.add(make_seq(0, 10, 4))  # 3 blocks
    sched.add(make_seq(1, 14, 2))  # 4 blocks: does not fit beside seq 0
    sched.add(make_seq(2, 2, 2))  # would fit, but must not overtake seq 1
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0]


def test_preemption_frees_the_newest_and_requeues_it_first():
    bm = BlockManager(5, 4)
    sched = make_scheduler(bm, max_num_batched_tokens=100, max_model_len=200)
    eng = FakeEngine(sched)
    sched.add(make_seq(0, 8, 8))  # 2 blocks, grows to 4
    sched.add(make_seq(1, 8, 8))
    eng.step()  # both prefilled: 2 blocks each, 1 left; each now holds 9 tokens
    out = eng.step()  # position 8 needs a third block each: seq 1 (the newest) makes room
    assert [s.seq_id for s in out.preempted] == [1] and sched.waiting[0].seq_id == 1
    assert sched.waiting[0].num_preemptions == 1 and sched.num_preemptions == 1
    eng.run()
    assert sorted(s.seq_id for s in eng.finished) == [0, 1]
    assert all(len(s.output_ids) == 8 for s in eng.finished)


def test_static_policy_admits_a_new_batch_only_when_the_last_one_is_done():
    sched = make_scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100,
                           max_model_len=200,
                      scheduling="static")
    eng = FakeEngine(sched)
    for i, m in enumerate([2, 6, 2]):
        sched.add(make_seq(i, 3, m))
    eng.step()
    while any(s.seq_id == 1 for s in sched.running):
        out = eng.step()
        # a slot is free, but the batch is closed
        assert all(s.seq.seq_id != 2 for s in out.scheduled)
    out = eng.step()
    assert [s.seq.seq_id for s in out.scheduled] == [2]


def test_lookahead_slots_are_reserved_and_rolled_back():
    bm = BlockManager(64, 4)
    sched = make_scheduler(bm, max_num_batched_tokens=100, max_model_len=200, num_lookahead_slots=3)
    eng = FakeEngine(sched, accept=1)
    sched.add(make_seq(0, 7, 10))
    eng.step()  # prefill: no lookahead
    out = eng.step()
    s = out.scheduled[0]
    assert s.num_lookahead == 3 and s.context_len == 7
    seq = s.seq
    assert seq.num_computed_tokens == 7 + 1 + 1  # the input token and one accepted draft
    assert seq.num_tokens == seq.num_computed_tokens + 1 and len(seq.block_table) == 3
    eng.run()
    assert len(seq.output_ids) == 10 and sum(bm.ref_counts) == 0


def test_requests_that_can_never_run_are_refused_when_added():
    sched = make_scheduler(BlockManager(4, 4), max_num_batched_tokens=8, max_model_len=30,
                           enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(make_seq(0, 25, 10))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(make_seq(1, 10, 10))
    with pytest.raises(ValueError, match="chunked prefill is off"):
        sched.add(make_seq(2, 9, 2))
    with pytest.raises(ValueError, match="policy"):
        make_scheduler(BlockManager(4, 4), scheduling="fifo")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_no_workload_leaks_a_block(data):
    """Random arrivals, lengths, n, EOS, aborts, prefix sharing, tiny pools (preemption),
    lookahead, FCFS or priority: invariants hold every step, everything finishes, every
    block ends unreferenced."""
    block_size = data.draw(st.integers(1, 5), label="block_size")
    num_blocks = data.draw(st.integers(6, 40), label="num_blocks")
    sched = make_scheduler(BlockManager(num_blocks, block_size,
                                        enable_prefix_caching=data.draw(st.booleans())),
                      max_num_seqs=data.draw(st.integers(1, 6)),
                      max_num_batched_tokens=data.draw(st.integers(1, 24)),
                      max_model_len=block_size * num_blocks,
                      scheduling=data.draw(st.sampled_from(["continuous", "priority"])),
                      num_lookahead_slots=data.draw(st.integers(0, 2)))
    eng = FakeEngine(sched, seed=data.draw(st.integers(0, 99)),
                     eos_prob=data.draw(st.sampled_from([0.0, 0.1])),
                     in_order=data.draw(st.booleans()))
    shared = [7, 8, 9, 10, 11, 12, 13, 14]
    arrivals = data.draw(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 14),
                                            st.integers(1, 8),
                                            st.integers(1, 3), st.booleans(),
                                            st.none() | st.integers(0, 8)),
                                  min_size=1, max_size=8), label="requests")
    pending = sorted(enumerate(arrivals), key=lambda a: a[1][0])
    aborts: dict[int, str] = {}
    rng = random.Random(0)
    for step in range(2000):
        while pending and pending[0][1][0] <= step:
            i, (_, n_prompt, max_tokens, n, share, abort_at) = pending.pop(0)
            prompt = (shared + [rng.randrange(1, 50) for _ in range(n_prompt)]) if share else None
            try:
                seq = make_seq(i, n_prompt, max_tokens, n=n, prompt=prompt)
                seq.priority = rng.randrange(3)  # only the "priority" policy looks at it
                sched.add(seq)
            except ValueError:  # only a request that could never run is refused
                total = (len(prompt) if prompt else n_prompt) + max_tokens
                assert total > sched.max_model_len or n > sched.max_num_seqs or \
                    sched.bm.blocks_for(total + sched.num_lookahead_slots) > num_blocks
                continue
            if abort_at is not None:
                aborts[step + abort_at] = str(i)
        if step in aborts:
            sched.abort(aborts[step])
            check_invariants(sched)
        if not sched.has_unfinished() and not pending:
            break
        if sched.has_unfinished():
            assert eng.step().scheduled, "no progress"
            check_invariants(sched)
    else:
        raise AssertionError("workload did not finish")
    assert all(r == 0 for r in sched.bm.ref_counts)
    assert sched.bm.num_free_blocks == num_blocks
    assert sorted(sched._free_rows) == list(range(sched.max_num_seqs))


def test_plain_steps_tokens_in_order_advance_sequences_as_the_dict_does():
    """postprocess(out, None, in_order=tokens) (the engine's plain decode steps) leaves every
    sequence, block and finish exactly as postprocess(out, {seq_id: [token]}) does, EOS and
    max_tokens included; a token count that does not match the step is refused."""
    runs = []
    for in_order in (False, True):
        sched = make_scheduler(BlockManager(30, 4, enable_prefix_caching=True), max_num_seqs=5,
                               max_num_batched_tokens=12, max_model_len=120)
        eng = FakeEngine(sched, seed=3, eos_prob=0.05, in_order=in_order)
        for i in range(7):
            sched.add(make_seq(i, 3 + i, 4 + 2 * i, prompt=[7, 8, 9, 10] + [i + 1] * i))
        eng.run()
        runs.append(([(q.seq_id, q.output_ids, q.finish_reason) for q in eng.finished],
                     [(o.plain_decodes, len(o.scheduled)) for o in eng.steps]))
    assert runs[0] == runs[1] and any(p == n > 0 for p, n in runs[0][1])
    sched = make_scheduler(BlockManager(8, 4), max_num_seqs=2, max_num_batched_tokens=8,
                           max_model_len=32)
    sched.add(make_seq(0, 3, 2))
    out = sched.schedule()
    with pytest.raises(ValueError, match="2 tokens for 1 sequences"):
        sched.postprocess(out, None, in_order=[1, 2])
