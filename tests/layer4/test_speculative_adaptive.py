"""adaptive_k: each sequence's proposal length follows its acceptance (+1 after a round that
accepted everything, -1 after a rejection, within 1..k); greedy output stays identical."""
from __future__ import annotations

import pytest

import layer3_model as l3
from layer4_algorithms.spec.decoder import SpeculativeDecoder

from .test_speculative import PROMPTS, Oracle


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_adaptive_k_greedy_equals_plain_greedy(target, draft, proposer):
    params = [l3.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (29, 9, 35)]
    ref = target.generate_outputs(PROMPTS, params)
    dec = SpeculativeDecoder(target, draft if proposer == "draft" else "ngram", 5,
                             adaptive_k=True)
    out = dec.generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert dec.stats.proposed <= 5 * dec.stats.rounds


@pytest.mark.parametrize("wrong", [False, True])
def test_adaptive_k_shrinks_on_rejection_and_holds_on_acceptance(target, wrong):
    params = l3.SamplingParams(temperature=0, max_tokens=31, ignore_eos=True)
    ref = target.generate_outputs(PROMPTS[:1], params)
    oracle = Oracle([target.encode(PROMPTS[0])], ref, wrong=wrong)
    dec = SpeculativeDecoder(target, oracle, k=4, adaptive_k=True)
    out = dec.generate(PROMPTS[:1], params)
    assert out[0].token_ids == ref[0].token_ids
    s = dec.stats
    if wrong:  # 4, 3, 2, then 1 guess per round; the 30th round may propose none (max_tokens)
        assert s.rounds == 30 and s.proposed == 4 + 3 + 2 + 1 * 26
    else:  # k stays 4: rounds of 5 tokens (the last one cut by max_tokens)
        assert s.accepted == s.proposed and s.rounds == 6
