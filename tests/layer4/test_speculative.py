"""Speculative decoding with the course models: greedy output identical to plain greedy
(draft model and n-gram proposers, k = 1, 3, 5, a batch of prompts of different lengths and
finish rules), the proposers, KV rollback, and the acceptance statistics."""
from __future__ import annotations

import pytest
import torch

import layer3_model as l3
from layer4_algorithms.spec.decoder import SpeculativeDecoder
from layer4_algorithms.spec.proposers import DraftModelProposer, NgramProposer, Proposal
from layer4_algorithms.spec.sampling import verify_input_ids, verify_logits

PROMPTS = [
    "HAMLET.\nTo be, or not to be, that is the question.\n\nHORATIO.\n",
    "ROMEO.\n",
    "JULIET.\nO Romeo, Romeo, wherefore art thou Romeo?\nDeny thy father and refuse thy "
    "name.\n\nROMEO.\n",
]


@pytest.fixture(scope="module")
def reference(target):
    """Plain greedy (layer 3) for the batch: EOS honoured, one stop string, different lengths."""
    params = [l3.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              l3.SamplingParams(temperature=0, max_tokens=17),
              l3.SamplingParams(temperature=0, max_tokens=40, stop=("\n\n",))]
    return params, target.generate_outputs(PROMPTS, params)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_greedy_speculation_equals_plain_greedy(target, draft, reference, method, k):
    params, ref = reference
    dec = SpeculativeDecoder(target, draft if method == "draft" else "ngram", k)
    out = dec.generate(PROMPTS, params)
    for o, r in zip(out, ref, strict=True):
        assert (o.token_ids, o.text, o.finish_reason) == (r.token_ids, r.text, r.finish_reason)
    s = dec.stats
    assert s.generated_tokens == sum(len(r.token_ids) for r in ref)
    assert 0 <= s.accepted <= s.proposed <= k * s.rounds
    assert 1 <= s.mean_tokens_per_round <= k + 1
    assert s.rounds < s.generated_tokens  # speculation saved target passes
    if method == "draft":
        assert s.acceptance_rate > 0.2 and s.draft_steps > 0


class Oracle:
    """Proposes what plain greedy will emit (right), or that plus one (always wrong)."""

    def __init__(self, prompts_ids, outputs, wrong=False):
        self.full = [p + o.token_ids for p, o in zip(prompts_ids, outputs, strict=True)]
        self.wrong = wrong

    def propose(self, token_ids, rows, k, params, generators):
        guesses = []
        for ids, r, kb in zip(token_ids, rows, k, strict=True):
            g = self.full[r][len(ids): len(ids) + kb]
            guesses.append([(t + 1) % 4096 for t in g] if self.wrong else g)
        K = max(len(g) for g in guesses)
        tokens = torch.tensor([g + [0] * (K - len(g)) for g in guesses],
                              dtype=torch.int64).view(len(guesses), K)
        return Proposal(tokens, torch.tensor([len(g) for g in guesses]))

    def release(self, row):
        pass


@pytest.mark.parametrize("wrong", [False, True])
def test_perfect_and_useless_proposals_bound_the_round_count(target, wrong):
    params = l3.SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)
    ref = target.generate_outputs(PROMPTS[:2], params)
    oracle = Oracle([target.encode(p) for p in PROMPTS[:2]], ref, wrong=wrong)
    dec = SpeculativeDecoder(target, oracle, k=4)
    out = dec.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    s = dec.stats
    if wrong:  # every guess rejected: one token per round, like plain decoding
        assert s.accepted == 0 and s.rounds == 2 * 20 and s.mean_tokens_per_round == 1
    else:  # everything accepted: 20 tokens after prefill in rounds of 5
        assert s.acceptance_rate == 1 and s.rounds == 2 * 4 and s.mean_tokens_per_round == 5


def test_ngram_lookup():
    ng = NgramProposer(min_n=1, max_n=3)
    assert ng.lookup([5, 1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]  # the 3-gram 1 2 3
    assert ng.lookup([1, 2, 7, 1, 2, 8, 2], 2) == [8, 2]  # latest match of the 1-gram "2"
    assert ng.lookup([1, 2, 7, 5, 1, 2], 5) == [7, 5, 1, 2]  # runs into the sequence end
    assert ng.lookup([1, 2, 3], 4) == [] and ng.lookup([4, 4], 0) == []
    assert NgramProposer(min_n=2, max_n=2).lookup([1, 2, 7, 9, 2], 3) == []  # no 2-gram repeats
    p = ng.propose([[5, 1, 2, 3, 4, 9, 1, 2, 3], [1, 2, 3]], [0, 1], [2, 2], None, None)
    assert p.tokens.tolist() == [[4, 9],
                                 [0, 0]] and p.num_tokens.tolist() == [2, 0] and p.probs is None
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(min_n=3, max_n=2)


def test_draft_proposals_are_the_drafts_greedy_continuation(draft):
    """After rejections and full accepts, the draft's cache rolls back by itself: its
    proposals always equal what a fresh run of the draft would say."""
    greedy = l3.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = draft.encode(PROMPTS[0])
    prop = DraftModelProposer(draft.net, max_seqs=2, max_len=128)
    seq = list(ids)
    for accept in (0, 4, 2, 4, 1):  # how many of the 4 guesses the "target" keeps each round
        p = prop.propose([seq], [1], [4], [greedy], [None])
        expected = draft.generate_outputs([seq], l3.SamplingParams(temperature=0, max_tokens=4,
                                                                   ignore_eos=True))
        assert p.tokens[0].tolist() == expected[0].token_ids
        # a correction or bonus token
        bonus = (p.tokens[0, accept].item() + 1) % 4096 if accept < 4 else 17
        seq = seq + p.tokens[0, :accept].tolist() + [bonus]
    p = prop.propose([seq], [1], [4], [greedy], [None])
    # all but the last guess went through the draft
    assert prop.cached[1] == seq + p.tokens[0, :3].tolist()
    prop.release(1)
    assert prop.cached[1] == []


def test_verify_pass_then_rollback_gives_fresh_logits(target):
    """Verify four wrong guesses, keep none (rollback), continue: the logits equal a fresh
    run over the same tokens, so the rejected k, v left in the cache did no harm."""
    net, cfg = target.net, target.config
    ids = target.encode(PROMPTS[2])
    cache = l3.ContiguousKVCache.for_model(cfg, 1, 128, dtype=net.dtype)
    with torch.no_grad():
        net(torch.tensor(ids[:-1]), cache.context([len(ids) - 1], [0]), cache)
        proposal = Proposal(torch.tensor([[11, 12, 13, 14]]), torch.tensor([4]))
        x, qlens = verify_input_ids([ids[-1]], proposal)
        assert x.tolist() == [ids[-1], 11, 12, 13, 14] and qlens == [5]
        verified = verify_logits(net(x, cache.context(qlens, [len(ids) - 1]), cache), qlens, 4)
        assert verified.shape == (1, 5, cfg.vocab_size)
        cached = len(ids)  # rollback: last token kept, the four guesses dropped
        nxt = [int(verified[0, 0].argmax()), 42]
        cont = net(torch.tensor(nxt), cache.context([2], [cached]), cache)
        fresh = net.causal_lm_logits(torch.tensor([ids + nxt]))[0]
    torch.testing.assert_close(verified[0, 0], fresh[len(ids) - 1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cont, fresh[-2:], atol=1e-4, rtol=1e-4)


def test_sampled_speculation_is_seeded_and_sensible(target, draft):
    params = l3.SamplingParams(temperature=0.8, top_k=40, seed=7, max_tokens=24, ignore_eos=True)
    dec = SpeculativeDecoder(target, draft, k=3)
    a = dec.generate(PROMPTS[:2], params)
    b = dec.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 24 for o in a)
    assert 0.1 < dec.stats.acceptance_rate <= 1 and dec.stats.rounds < 2 * 23


def test_stop_below_shortens_proposals_but_not_the_output(target, draft, reference):
    params, ref = reference
    fixed, dyn = SpeculativeDecoder(target, draft,
                                    6), SpeculativeDecoder(target, draft, 6, stop_below=0.5)
    out = dyn.generate(PROMPTS, params)
    fixed.generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert dyn.stats.proposed / dyn.stats.rounds < fixed.stats.proposed / fixed.stats.rounds
    assert dyn.stats.acceptance_rate > fixed.stats.acceptance_rate


def test_bad_arguments_are_named(target):
    with pytest.raises(ValueError, match="k"):
        SpeculativeDecoder(target, "ngram", k=0)
    with pytest.raises(ValueError, match="unknown proposer"):
        SpeculativeDecoder(target, "medusa")
    cfg = l3.ModelConfig(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8)
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeDecoder(target, l3.Model(l3.random_model(cfg)))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        SpeculativeDecoder(target,
                           "ngram").generate(["ROMEO.\n"], l3.SamplingParams(max_tokens=600))


def test_bench_speculative_reports_rates_and_acceptance():
    from layer4_algorithms.bench.speculative import bench_speculative, format_bench

    r = bench_speculative(ks=(2,), dynamic=((3, 0.4),), ngram_ks=(2,),
                          prompts={"romeo": "ROMEO.\n"},
                          copy_prompt="ROMEO.\nROMEO.\n", new_tokens=8, repeats=1, threads=None)
    rows = r["prompts"]["romeo"]["rows"]
    assert [(x["method"], x["k"],
             x["stop_below"]) for x in rows] == [("draft", 2, None), ("draft", 3, 0.4),
                                                                       ("ngram", 2, None)]
    assert all(x["matches_greedy"] and x["tokens_per_s"] > 0 and x["speedup"] > 0 for x in rows)
    assert r["prompts"]["romeo"]["target_tokens_per_s"] > 0
    assert set(r["prompts"]) == {"romeo", "copy"}
    assert "draft k=2" in r["summary"] and "geometric-mean" in format_bench(r)
