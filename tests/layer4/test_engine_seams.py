"""Small engine seams layer 6 relies on: per-request speculative counts, close() and the
context manager, and speculation refusing penalties / logprobs."""
from __future__ import annotations

import re

import numpy as np
import pytest

from layer4_algorithms import LLM, SamplingParams

from .l4_helpers import greedy


def test_per_request_spec_counts_add_up_to_the_engine_figures(tiny_model):
    # repetitive prompts: prompt lookup (ngram) finds something to propose
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7, [12, 13] * 9]
    llm = LLM(tiny_model, num_blocks=128, block_size=4,
              speculative={"method": "ngram", "k": 3, "ngram": (1, 3)})
    outs = llm.generate(prompts, greedy(24))
    proposed = [o.metrics.spec_proposed for o in outs]
    accepted = [o.metrics.spec_accepted for o in outs]
    assert sum(proposed) == llm.stats.spec_proposed > 0
    assert sum(accepted) == llm.stats.spec_accepted
    assert all(0 <= a <= p for a, p in zip(accepted, proposed, strict=True))
    for o in outs:
        want = o.metrics.spec_accepted / o.metrics.spec_proposed if o.metrics.spec_proposed \
            else None
        assert o.metrics.spec_acceptance == want


def test_speculation_refuses_penalties_and_logprobs(tiny_model):
    llm = LLM(tiny_model, num_blocks=64, block_size=4, speculative={"method": "ngram", "k": 2})
    for extra in (dict(logprobs=1), dict(presence_penalty=0.5), dict(frequency_penalty=-1.0)):
        with pytest.raises(ValueError, match="speculative decoding"):
            llm.add_request([5, 6, 7], SamplingParams(max_tokens=4, **extra))
    assert not llm.has_unfinished()


def test_close_and_context_manager(tiny_model):
    with LLM(tiny_model, num_blocks=64, block_size=4) as llm:
        assert not llm.closed
        assert llm.generate([[5, 6, 7]], greedy(3))[0].finished
    assert llm.closed
    llm.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        llm.add_request([5, 6, 7], greedy(3))


def test_token_id_prompts_give_the_models_ids_and_errors(tiny_model):
    """add_request packs a list or tuple of ids itself: the same ids as the model's encode
    (int() of each: bools, numpy ints; floats and strings through the model's encode), the
    prompt kept as an int64 array for the runner, and the model's errors for what is not a
    valid prompt."""
    llm = LLM(tiny_model, num_blocks=64, block_size=4)
    vocab = tiny_model.config.vocab_size
    for prompt in ([5, 6, 7], (5, 6, 7), [np.int64(5), True, 7], [vocab - 1, 0], [5, 7.0],
                   ["5", 6]):
        rid = llm.add_request(prompt, greedy(1))
        seq = llm._requests[rid][1][0]
        want = tiny_model.encode(prompt)
        assert seq.prompt_ids == want
        if all(not isinstance(t, float | str) for t in prompt):  # (else the model's encode)
            assert seq.prompt_array.dtype == np.int64 and seq.prompt_array.tolist() == want
        out = llm.abort(rid)  # (an output's ids are ints, also before any step ran)
        assert out.prompt_token_ids == want and all(type(t) is int for t in seq.prompt_ids)
    # ids that are not ints become ints behind the first launch, forks included, and the
    # outputs equal those of the same prompt as ints
    odd = [np.int64(5), True, 7, np.int32(9)] * 3
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, n=2)
    plain = llm.generate([[int(t) for t in odd]], params)[0]
    rid = llm.add_request(odd, params)
    seqs = llm._requests[rid][1]
    done = llm.step(unfinished=False)
    assert len(seqs) == 2  # (forked at the first token)
    assert all(type(t) is int for q in seqs for t in q.token_ids + q.prompt_ids)
    while llm.has_unfinished():
        done += llm.step(unfinished=False)
    assert [c.token_ids for c in done[0].outputs] == [c.token_ids for c in plain.outputs]
    assert done[0].prompt_token_ids == plain.prompt_token_ids
    rid = llm.add_request(np.array([5, 6]), greedy(1))  # (other kinds: the model's encode)
    assert llm._requests[rid][1][0].prompt_ids == [5, 6]
    llm.abort(rid)
    for bad in ([], [vocab], [-1, 3], [None], [[1], [2]], [2**70]):
        with pytest.raises((ValueError, TypeError, OverflowError)) as got:
            llm.add_request(bad, greedy(1))
        with pytest.raises(got.type, match=re.escape(str(got.value))):
            tiny_model.encode(bad)
    assert not llm.has_unfinished()
