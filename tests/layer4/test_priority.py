"""Scheduling policy "priority": the waiting queue in (priority, arrival) order, the lowest
priority running sequence as the preemption victim, and the engine passing priority down."""
from __future__ import annotations

import random

import pytest

from layer4_algorithms import LLM, BlockManager, SamplingParams, Sequence

from .l4_helpers import assert_no_leak, greedy, random_prompts
from .test_scheduler import EOS, FakeEngine, check_invariants, make_scheduler


def seq(i: int, priority: int, n_prompt: int = 4, max_tokens: int = 4) -> Sequence:
    rng = random.Random(i)
    return Sequence(i, str(i), [rng.randrange(1, 50) for _ in range(n_prompt)],
                    SamplingParams(max_tokens=max_tokens), eos_token_ids=(EOS,),
                    arrival_time=float(i), priority=priority)


def test_waiting_queue_is_ordered_by_priority_then_arrival():
    sched = make_scheduler(BlockManager(64, 4), scheduling="priority", max_num_seqs=2,
                           max_model_len=200)
    for i, prio in enumerate([5, 0, 5, -1, 0]):
        sched.add(seq(i, prio))
    assert [s.seq_id for s in sched.waiting] == [3, 1, 4, 0, 2]
    out = sched.schedule()  # two seats: the two most urgent
    assert [s.seq.seq_id for s in out.scheduled] == [3, 1]


def test_fcfs_ignores_priority():
    sched = make_scheduler(BlockManager(64, 4), max_num_seqs=2, max_model_len=200)
    for i, prio in enumerate([5, 0, -1]):
        sched.add(seq(i, prio))
    assert [s.seq.seq_id for s in sched.schedule().scheduled] == [0, 1]


def test_preemption_takes_the_lowest_priority_running_sequence():
    bm = BlockManager(5, 4)
    sched = make_scheduler(bm, scheduling="priority", max_num_batched_tokens=100,
                           max_model_len=200)
    eng = FakeEngine(sched)
    sched.add(seq(0, priority=3, n_prompt=8, max_tokens=8))  # arrives first, least urgent
    sched.add(seq(1, priority=1, n_prompt=8, max_tokens=8))
    eng.step()  # both prefilled, 2 blocks each, 1 left
    assert [s.seq_id for s in sched.running] == [1, 0]  # served in priority order
    out = eng.step()  # both need a third block: FCFS would evict seq 1 (the newest)
    assert [s.seq_id for s in out.preempted] == [0]
    assert sched.waiting[0].seq_id == 0 and sched.waiting[0].num_preemptions == 1
    check_invariants(sched)
    eng.run()
    assert sorted(s.seq_id for s in eng.finished) == [0, 1]


def test_preempted_sequence_waits_behind_more_urgent_arrivals():
    sched = make_scheduler(BlockManager(5, 4), scheduling="priority",
                           max_num_batched_tokens=100, max_model_len=200)
    eng = FakeEngine(sched)
    sched.add(seq(0, priority=3, n_prompt=8, max_tokens=8))
    sched.add(seq(1, priority=1, n_prompt=8, max_tokens=8))
    eng.step()
    sched.add(seq(2, priority=2))
    eng.step()  # seq 0 preempted: it goes behind seq 2 (priority 2 < 3)
    assert [s.seq_id for s in sched.waiting] == [2, 0]


def test_engine_priority_order(tiny_model):
    """One seat: requests run one after another, most urgent first; FCFS keeps arrival order."""
    prompts = random_prompts([4, 4, 4], seed=1)
    for policy, want in (("priority", ["c", "b", "a"]), ("continuous", ["a", "b", "c"])):
        llm = LLM(tiny_model, num_blocks=64, block_size=4, max_num_seqs=1, scheduling=policy)
        for rid, p, prio in zip("abc", prompts, [2, 1, 0], strict=True):
            llm.add_request(p, greedy(2), request_id=rid, priority=prio)
        order = []
        while llm.has_unfinished():
            order += [o.request_id for o in llm.step(unfinished=False)]
        assert order == want
        assert_no_leak(llm)
    with pytest.raises(ValueError, match="priority"):
        llm.add_request(prompts[0], greedy(2), priority="high")
