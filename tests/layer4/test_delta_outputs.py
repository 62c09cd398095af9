"""LLM.step(delta=True): each output carries only what is new since the request's last one.
Joined up, a request's deltas are exactly generate()'s output (token ids, text, logprobs,
finish reason), for parallel sampling, stop strings held back across tokens, EOS, logprobs,
aborts and late arrivals, with async scheduling on and off."""
from __future__ import annotations

import pytest

from layer4_algorithms import LLM, SamplingParams

from .l4_helpers import assert_no_leak, greedy, random_prompts


def run_deltas(llm, prompts, params, *, abort_at: dict[str, int] | None = None,
               late: int = 0) -> dict:
    """Drive llm.step(delta=True) like a server; {request id: {index: [ids, text, lps,
    reason]}} joined from the deltas. Requests after the first `late` arrive at step 2."""
    joined: dict = {}
    abort_at = abort_at or {}

    def add(i: int) -> None:
        llm.add_request(prompts[i], params[i], request_id=str(i))

    for i in range(len(prompts) - late):
        add(i)
    step = 0
    while llm.has_unfinished() or step < 3:
        if step == 2:
            for i in range(len(prompts) - late, len(prompts)):
                add(i)
        for rid, at in abort_at.items():
            if step == at:
                llm.abort(rid)
        for o in llm.step(delta=True):
            first = o.request_id not in joined
            assert bool(o.prompt_token_ids) is first  # the prompt's ids only once
            per = joined.setdefault(o.request_id, {})
            for c in o.outputs:
                j = per.setdefault(c.index, [[], "", None if c.logprobs is None else [], None])
                assert j[3] is None  # nothing after a completion's end
                j[0] += c.token_ids
                j[1] += c.text
                if c.logprobs is not None:
                    j[2] += c.logprobs
                j[3] = c.finish_reason
        step += 1
        assert step < 500
    llm.drain()
    assert_no_leak(llm)
    return joined


@pytest.mark.parametrize("mode", [False, True])
def test_joined_deltas_equal_generate(tiny_model, mode):
    prompts = random_prompts([5, 9, 3, 12, 1, 7], seed=31)
    params = [SamplingParams(temperature=0.9, max_tokens=8, n=3, seed=7, ignore_eos=True),
              greedy(11, logprobs=2), greedy(6),
              SamplingParams(temperature=0.0, max_tokens=40),  # ends at EOS (id 1) or 40
              greedy(1), greedy(13)]
    kw = dict(block_size=4, num_blocks=120, max_num_seqs=5, max_num_batched_tokens=9)
    want = LLM(tiny_model, async_scheduling=mode, **kw).generate(prompts, params)
    got = run_deltas(LLM(tiny_model, async_scheduling=mode, **kw), prompts, params, late=2)
    for i, w in enumerate(want):
        assert sorted(got[str(i)]) == [c.index for c in w.outputs]
        for c in w.outputs:
            ids, text, lps, reason = got[str(i)][c.index]
            assert (ids, text, reason) == (c.token_ids, c.text, c.finish_reason), (i, c.index)
            if c.logprobs is not None:
                assert [t.logprob for t in lps] == pytest.approx([t.logprob for t in c.logprobs])


def test_stop_strings_never_leak_through_deltas(course_model):
    prompts = ["ROMEO.\n", "JULIET.\nO Romeo", "First Citizen:\n", "KING"]
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop=["\n\n"]),
              SamplingParams(temperature=0.0, max_tokens=25, stop=["the", "e"]),
              SamplingParams(temperature=0.0, max_tokens=30, stop=["ing,", "\n"]),
              SamplingParams(temperature=0.0, max_tokens=20)]
    kw = dict(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=32)
    want = LLM(course_model, **kw).generate(prompts, params)
    got = run_deltas(LLM(course_model, **kw), prompts, params)
    for i, w in enumerate(want):
        ids, text, _, reason = got[str(i)][0]
        assert (ids, text, reason) == (w.outputs[0].token_ids, w.outputs[0].text,
                                       w.outputs[0].finish_reason)
        for s in params[i].stop:
            assert s not in text


def test_an_aborted_request_streams_a_prefix(tiny_model):
    prompts = random_prompts([6, 8, 4], seed=5)
    params = [greedy(20)] * 3
    full = LLM(tiny_model, num_blocks=60, block_size=4).generate(prompts, params)
    got = run_deltas(LLM(tiny_model, num_blocks=60, block_size=4), prompts, params,
                     abort_at={"1": 5})
    ids = got["1"][0][0]
    assert 0 < len(ids) < 20 and ids == full[1].outputs[0].token_ids[:len(ids)]
    assert got["0"][0][0] == full[0].outputs[0].token_ids
