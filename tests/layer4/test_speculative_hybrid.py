"""ngram_first (NgramThenDraftProposer): the lookup answers rows whose suffix occurred
earlier, the draft the others; greedy output stays identical to plain greedy, sampled rows
get one-hot q for looked-up guesses and the draft's q for its own."""
from __future__ import annotations

import pytest
import torch

import layer3_model as l3
from layer4_algorithms.spec.decoder import SpeculativeDecoder
from layer4_algorithms.spec.proposers import (
    DraftModelProposer,
    NgramProposer,
    NgramThenDraftProposer,
)

PROMPTS = ["HAMLET.\nTo be, or not to be, that is the question.\n\nHORATIO.\n", "ROMEO.\n",
           "KING.\nNow is the winter of our discontent\nKING.\nNow is the winter of"]


@pytest.mark.parametrize("k", [2, 5])
def test_greedy_ngram_first_equals_plain_greedy(target, draft, k):
    params = [l3.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (33, 12, 25)]
    ref = target.generate_outputs(PROMPTS, params)
    dec = SpeculativeDecoder(target, draft, k, ngram_first=True)
    out = dec.generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    s = dec.stats
    assert s.rounds < s.generated_tokens and 0 <= s.accepted <= s.proposed <= k * s.rounds


def test_rows_split_between_lookup_and_draft(target, draft):
    ids = [target.encode(p) for p in PROMPTS]
    prop = NgramThenDraftProposer(DraftModelProposer(draft.net, 3, 256), NgramProposer(2, 4))
    greedy = [l3.SamplingParams(temperature=0)] * 3
    out = prop.propose(ids, [0, 1, 2], [3, 3, 3], greedy, None)
    hit = NgramProposer(2, 4).lookup(ids[2], 3)
    assert hit and out.tokens[2, :len(hit)].tolist() == hit  # the repeated line: looked up
    assert prop.lookups >= 1 and prop.steps > 0  # the others went to the draft
    assert out.probs is None

    sampled = [l3.SamplingParams(temperature=0.8, seed=s) for s in range(3)]
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    prop2 = NgramThenDraftProposer(DraftModelProposer(draft.net, 3, 256), NgramProposer(2, 4))
    out = prop2.propose(ids, [0, 1, 2], [3, 3, 3], sampled, gens)
    assert out.probs is not None and out.probs.shape[:2] == out.tokens.shape
    n2 = int(out.num_tokens[2])
    onehot = out.probs[2, torch.arange(n2), out.tokens[2, :n2]]
    assert torch.equal(onehot, torch.ones(n2))  # looked-up guesses: q one-hot
    for b in (0, 1):  # the draft's rows: proper distributions
        n = int(out.num_tokens[b])
        assert torch.allclose(out.probs[b, :n].sum(-1), torch.ones(n), atol=1e-4)


def test_ngram_first_needs_a_draft(target):
    with pytest.raises(ValueError, match="draft model"):
        SpeculativeDecoder(target, "ngram", 3, ngram_first=True)
