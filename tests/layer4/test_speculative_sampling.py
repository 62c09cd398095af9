"""Exact rejection sampling: unit cases (q == p, disjoint supports, one-hot n-gram guesses,
greedy) and statistical checks that speculative sampling reproduces the target's distribution,
for the sampler alone and end to end with a tiny random target and a different random draft.
Everything is seeded: the tests are deterministic and each one takes well under a second."""
from __future__ import annotations

import copy

import pytest
import torch

import layer3_model as l3
from layer4_algorithms.spec.decoder import SpeculativeDecoder
from layer4_algorithms.spec.sampling import (
    accept_proposals,
    greedy_accept,
    processed_probs,
    rejection_sample,
    sample_from_probs,
)

V = 12


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_probs(gen, *shape, sharp=1.5):
    return torch.softmax(sharp * torch.randn(*shape, V, generator=gen), dim=-1)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells with expected count >= 5 (the rest pooled)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    return float(stat), int(keep.sum()) - 1


def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof): the regularized upper incomplete gamma
    Q(dof/2, stat/2)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def assert_matches(samples: torch.Tensor, probs: torch.Tensor, alpha: float = 1e-3) -> None:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    stat, dof = chi_square(counts, probs.double())
    assert chi2_sf(stat, dof) > alpha, (stat, dof, counts / counts.sum(), probs)


def repeat_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.expand(n, *x.shape[1:]).contiguous()


def test_q_equal_p_always_accepts_and_the_bonus_follows_p():
    gen = torch.Generator().manual_seed(0)
    N, K = 20000, 3
    p = repeat_rows(random_probs(gen, 1, K + 1), N)
    draft = sample_from_probs(p[:, :K], torch.rand(N, K, generator=gen))
    acc = rejection_sample(p, draft, torch.full((N,), K), p[:, :K].clone(),
                           torch.rand(N, K + 1, generator=gen))
    assert (acc.num_accepted == K).all()
    assert torch.equal(acc.tokens[:, :K], draft)
    assert_matches(acc.tokens[:, K], p[0, K])


def test_disjoint_support_rejects_first_guess_and_resamples_from_p():
    gen = torch.Generator().manual_seed(1)
    N, K = 20000, 2
    p = torch.zeros(1, K + 1, V)
    p[..., 6:] = random_probs(gen, 1, K + 1)[..., :6]
    p = repeat_rows(p / p.sum(-1, keepdim=True), N)
    q = torch.zeros(N, K, V)
    q[..., :6] = 1 / 6
    draft = torch.randint(0, 6, (N, K), generator=gen)
    acc = rejection_sample(p, draft, torch.full((N,), K), q, torch.rand(N, K + 1, generator=gen))
    assert (acc.num_accepted == 0).all() and (acc.tokens[:, 1:] == -1).all()
    assert (acc.tokens[:, 0] >= 6).all()
    assert_matches(acc.tokens[:, 0], p[0, 0])


def test_one_hot_guess_is_accepted_with_probability_p_and_otherwise_excluded():
    gen = torch.Generator().manual_seed(2)
    N, x = 40000, 3
    p = repeat_rows(random_probs(gen, 1, 2), N)
    draft = torch.full((N, 1), x)
    acc = rejection_sample(p, draft, torch.ones(N, dtype=torch.int64), None,
                           torch.rand(N, 2, generator=gen))
    accepted = acc.num_accepted == 1
    rate, expected = accepted.double().mean().item(), p[0, 0, x].item()
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / N) ** 0.5 + 1e-9
    rejected = acc.tokens[~accepted, 0]
    assert (rejected != x).all()
    residual = p[0, 0].clone()
    residual[x] = 0
    assert_matches(rejected, residual / residual.sum())
    assert_matches(acc.tokens[accepted, 1], p[0, 1])  # the bonus token


def test_emitted_token_distribution_equals_target_with_a_mismatched_draft():
    """The whole point: whatever q is, the first emitted token follows p_1, and the second
    (when the first guess was accepted) follows p_2."""
    gen = torch.Generator().manual_seed(3)
    N, K = 40000, 2
    p = repeat_rows(random_probs(gen, 1, K + 1), N)
    q = repeat_rows(random_probs(gen, 1, K, sharp=2.5), N)
    draft = sample_from_probs(q, torch.rand(N, K, generator=gen))
    acc = rejection_sample(p, draft, torch.full((N,), K), q, torch.rand(N, K + 1, generator=gen))
    assert_matches(acc.tokens[:, 0], p[0, 0])
    assert_matches(acc.tokens[acc.num_accepted >= 1, 1], p[0, 1])
    # and the check has teeth: the draft's own distribution is rejected
    counts = torch.bincount(acc.tokens[:, 0], minlength=V).double()
    stat, dof = chi_square(counts, q[0, 0].double())
    assert chi2_sf(stat, dof) < 1e-3


def test_padding_past_num_proposed_is_never_accepted():
    logits = torch.randn(2, 4, V, generator=torch.Generator().manual_seed(4))
    # one-hot: u does not matter
    p = processed_probs(logits, [l3.SamplingParams(temperature=0)] * 2)
    best = logits.argmax(-1)
    draft = best[:, :3].clone()  # all three would be accepted greedily
    acc = rejection_sample(p, draft, torch.tensor([1, 0]), None, torch.zeros(2, 4))
    assert acc.num_accepted.tolist() == [1, 0]
    assert acc.emitted() == [[int(best[0, 0]), int(best[0, 1])], [int(best[1, 0])]]


def test_greedy_path_equals_one_hot_rejection_sampling():
    gen = torch.Generator().manual_seed(5)
    B, K = 64, 4
    logits = torch.randn(B, K + 1, V, generator=gen)
    best = logits.argmax(-1)
    draft = torch.where(torch.rand(B, K, generator=gen) < 0.7, best[:, :K],
                        torch.randint(0, V, (B, K), generator=gen))
    n = torch.randint(0, K + 1, (B,), generator=gen)
    fast = greedy_accept(logits, draft, n)
    greedy = [l3.SamplingParams(temperature=0)] * B
    slow = rejection_sample(processed_probs(logits, greedy), draft, n, None,
                            torch.rand(B, K + 1, generator=gen))
    assert torch.equal(fast.tokens,
                       slow.tokens) and torch.equal(fast.num_accepted, slow.num_accepted)
    # a mixed batch: greedy rows give the greedy answer whatever the sampled rows do
    mixed = [l3.SamplingParams(temperature=0) if b % 2
             else l3.SamplingParams(temperature=1.0, seed=b) for b in range(B)]
    gens = [torch.Generator().manual_seed(b) for b in range(B)]
    out = accept_proposals(logits, draft, n, None, mixed, gens)
    assert torch.equal(out.tokens[1::2], fast.tokens[1::2])


def test_processed_probs_apply_temperature_top_k_top_p_per_row():
    logits = torch.randn(3, 2, V, generator=torch.Generator().manual_seed(6))
    params = [l3.SamplingParams(temperature=0), l3.SamplingParams(temperature=0.5, top_k=3),
              l3.SamplingParams(temperature=2.0, top_p=0.5)]
    probs = processed_probs(logits, params)
    assert torch.equal(probs[0].argmax(-1), logits[0].argmax(-1)) and (probs[0].sum(-1) == 1).all()
    assert ((probs[1] > 0).sum(-1) == 3).all()
    torch.testing.assert_close(probs[1], torch.softmax(l3.top_k_filter(logits[1] / 0.5, 3), -1))
    torch.testing.assert_close(probs[2], torch.softmax(l3.top_p_filter(logits[2] / 2.0, 0.5), -1))


def tiny_pair() -> tuple[l3.Model, l3.Model]:
    """A tiny random target and a draft made from it with noise added to every weight: close
    enough that about half the guesses are accepted, far enough that the residual matters."""
    cfg = l3.ModelConfig(model_type="llama", vocab_size=V, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8,
                         max_position_embeddings=64, eos_token_ids=())
    target = l3.random_model(cfg, seed=0, std=0.6)
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(0.3 * torch.randn(w.shape, generator=gen))
    return l3.Model(target), l3.Model(draft)


@pytest.mark.parametrize("top_k", [0, 5])
def test_speculative_sampling_end_to_end_matches_target_distribution(top_k):
    """2000 seeded sequences from one prefix, three tokens each: the first comes from prefill,
    the second and third out of a verify round with a draft of different weights. Their
    distributions must be the target's, computed exactly from its logits. (Drawing the
    correction from p instead of max(0, p - q) fails this with chi-square ~350 vs ~28 allowed.)"""
    target, draft = tiny_pair()
    prefix, N, T = [3, 7, 1], 2000, 1.0
    params = [l3.SamplingParams(temperature=T, top_k=top_k, seed=i, max_tokens=3, ignore_eos=True)
              for i in range(N)]
    dec = SpeculativeDecoder(target, draft, k=3)
    out = torch.tensor([o.token_ids for o in dec.generate([prefix] * N, params)])
    assert dec.stats.proposed > 0 and 0.2 < dec.stats.acceptance_rate < 0.9  # both paths taken

    def dist(ids):
        with torch.no_grad():
            logits = target.net.causal_lm_logits(torch.tensor([ids]))[0, -1]
        return processed_probs(logits[None], params[:1])[0].double()

    p1 = dist(prefix)
    p2 = {a: dist(prefix + [a]) for a in range(V) if p1[a] > 0}
    # second token: marginal over the first; third token given the most common first two
    marginal2 = sum(p1[a] * p2[a] for a in p2)
    assert_matches(out[:, 1], marginal2)
    a, b = torch.mode(out[:, 0]).values.item(), None
    rows = out[:, 0] == a
    b = torch.mode(out[rows, 1]).values.item()
    rows &= out[:, 1] == b
    assert rows.sum() > 100
    assert_matches(out[rows, 2], dist(prefix + [a, b]))
