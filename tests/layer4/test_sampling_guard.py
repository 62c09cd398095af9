"""One request whose numbers go bad cannot break the step for the others (sampling_guard.py):
a vanishing temperature / top-p is greedy, and a row whose probabilities are nan / inf ends
its own request with finish_reason "error" while every other request in the same step gets
exactly the tokens it gets without it (sync and async scheduling)."""
from __future__ import annotations

import pytest
import torch

from layer4_algorithms import LLM, SamplingParams
from layer4_algorithms.sampling_guard import normalize, sample_guarded

from .l4_helpers import assert_no_leak, greedy, random_prompts


def test_vanishing_temperature_and_top_p_are_greedy(tiny_model):
    for bad in (dict(temperature=1e-40), dict(temperature=5e-324), dict(top_p=5e-324),
                dict(temperature=0.7, top_p=1e-30)):
        assert normalize(SamplingParams(**bad)).greedy, bad
    assert not normalize(SamplingParams(temperature=0.5)).greedy
    prompts = random_prompts([7, 11], seed=3)
    ref = LLM(tiny_model).generate(prompts, greedy(8))
    for bad in (dict(temperature=1e-40), dict(top_p=5e-324), dict(temperature=1e-300)):
        got = LLM(tiny_model).generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True,
                                                                **bad))
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


def test_sample_guarded_flags_only_bad_rows():
    x = torch.randn(4, 50)
    x[2] = float("nan")
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(4)]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    tokens, bad = sample_guarded(x, params, gens)
    assert bad.tolist() == [False, False, True, False]
    assert all(0 <= t < 50 for t in tokens.tolist())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_hostile_row_ends_alone(tiny_model, async_scheduling):
    """16 requests (half seeded sampling, half greedy) and a hostile one in the middle whose
    temperature slipped past normalization: it ends with "error", the 16 match a run without it."""
    prompts = random_prompts([5 + i % 7 for i in range(16)], seed=1)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True)
              if i % 2 else greedy(12) for i in range(16)]

    def run(hostile: bool):
        llm = LLM(tiny_model, async_scheduling=async_scheduling)
        rids = [llm.add_request(p, sp) for p, sp in zip(prompts[:8], params[:8], strict=True)]
        if hostile:
            bad = llm.add_request([5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True))
            # as if normalization missed it: logits / 1e-40 overflow, softmax is nan
            llm._requests[bad][1][0].params = SamplingParams(temperature=1e-40, max_tokens=12,
                                                             ignore_eos=True)
        rids += [llm.add_request(p, sp) for p, sp in zip(prompts[8:], params[8:], strict=True)]
        done = {}
        while llm.has_unfinished():
            for o in llm.step(unfinished=False):
                done[o.request_id] = o
        for o in llm.drain():
            done[o.request_id] = o
        assert_no_leak(llm)
        return [done[r] for r in rids], (done[bad] if hostile else None)

    ref, _ = run(False)
    got, bad = run(True)
    assert bad.outputs[0].finish_reason == "error"
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert all(o.outputs[0].finish_reason == "length" for o in got)
