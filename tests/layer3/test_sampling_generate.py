"""Sampling semantics against references, and generate/stream behaviour: seeds, stop strings,
EOS, max_tokens, streaming == non-streaming, bad parameters."""
from __future__ import annotations

import pytest
import torch

import layer3_model as l3

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = ["To be, or not", "All the world"]


@pytest.fixture(scope="module")
def model(make_checkpoint):
    path, _ = make_checkpoint("llama-gqa")
    return l3.load(path, device="cpu")


def greedy(max_tokens: int, **kw) -> l3.SamplingParams:
    return l3.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


# ---- the sampler -------------------------------------------------------------------------
def test_top_k_filter_keeps_the_k_largest():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    out = l3.top_k_filter(logits, 5)
    for row, filtered in zip(logits, out, strict=True):
        keep = set(torch.topk(row, 5).indices.tolist())
        kept = {i for i in range(50) if filtered[i] != float("-inf")}
        assert kept == keep and torch.equal(filtered[list(keep)], row[list(keep)])
    assert torch.equal(l3.top_k_filter(logits, 0), logits) and torch.equal(l3.top_k_filter(logits, 50), logits)


def _nucleus_reference(row: torch.Tensor, p: float) -> set[int]:
    probs = torch.softmax(row, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return kept


@pytest.mark.parametrize("p", [1e-6, 0.3, 0.75, 0.95, 1.0])
def test_top_p_filter_keeps_the_nucleus(p):
    logits = 2 * torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    out = l3.top_p_filter(logits, p)
    for row, filtered in zip(logits, out, strict=True):
        kept = {i for i in range(40) if filtered[i] != float("-inf")}
        assert kept == _nucleus_reference(row, p)


def test_sampled_frequencies_follow_temperature_and_top_k():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    params = l3.SamplingParams(temperature=0.7, top_k=3)
    n = 4000
    gen = torch.Generator().manual_seed(0)
    draws = l3.sample(logits.expand(n, 4), [params] * n, [gen] * n)
    freq = torch.bincount(draws, minlength=4).float() / n
    expected = torch.cat([torch.softmax(logits[:3] / 0.7, dim=0), torch.zeros(1)])
    assert freq[3] == 0  # top-k removed it
    torch.testing.assert_close(freq, expected, atol=0.03, rtol=0)


def test_greedy_ignores_seed_and_filters():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(2))
    params = [l3.SamplingParams(temperature=0, top_k=2, seed=s) for s in range(3)]
    out = l3.sample(logits, params, [l3.make_generator(p) for p in params])
    assert torch.equal(out, logits.argmax(dim=-1))


@pytest.mark.parametrize("bad, field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.2), "top_p"),
    (dict(seed=-1), "seed"), (dict(max_tokens=0), "max_tokens"), (dict(stop=("",)), "stop"),
])
def test_bad_sampling_params_are_named(bad, field):
    with pytest.raises(ValueError, match=f"bad SamplingParams: {field}"):
        l3.SamplingParams(**bad)


def test_single_stop_string_is_accepted():
    assert l3.SamplingParams(stop="\n\n").stop == ("\n\n",)


# ---- generate ----------------------------------------------------------------------------
def test_max_tokens_per_request(model):
    outs = model.generate_outputs(PROMPTS, [greedy(3, ignore_eos=True), greedy(7, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [3, 7] and {o.finish_reason for o in outs} == {"length"}
    assert model.stats.generated_tokens == 10 and model.stats.sequences == 2
    assert model.stats.prompt_tokens == sum(len(o.prompt_ids) for o in outs)


def test_seeded_sampling_is_reproducible_and_batch_independent(model):
    params = l3.SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    first = model.generate_outputs([PROMPTS[0]], params)[0].token_ids
    assert model.generate_outputs([PROMPTS[0]], params)[0].token_ids == first
    batched = model.generate_outputs(PROMPTS, [params, l3.SamplingParams(seed=8, max_tokens=4)])
    assert batched[0].token_ids == first  # its own generator: the neighbour changes nothing
    other = l3.SamplingParams(temperature=1.0, top_p=0.9, seed=8, max_tokens=12, ignore_eos=True)
    assert model.generate_outputs([PROMPTS[0]], other)[0].token_ids != first


def test_eos_ends_a_sequence_unless_ignored(model):
    full = model.generate_outputs([PROMPTS[1]], greedy(10, ignore_eos=True))[0].token_ids
    k = next(i for i in range(2, 10) if full[i] not in full[:i])
    saved = model.eos_token_ids
    model.eos_token_ids = (full[k],)  # pretend the k-th greedy token is EOS
    try:
        out = model.generate_outputs([PROMPTS[1]], greedy(10))[0]
        assert out.token_ids == full[:k] and out.finish_reason == "eos"
        assert out.text == model.tokenizer.decode(full[:k])
        assert model.generate_outputs([PROMPTS[1]], greedy(10, ignore_eos=True))[0].token_ids == full
    finally:
        model.eos_token_ids = saved


def test_stop_strings_cut_the_output(model):
    full = model.generate_outputs([PROMPTS[0]], greedy(24, ignore_eos=True))[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    out = model.generate_outputs([PROMPTS[0]], greedy(24, ignore_eos=True, stop=("never there", stop)))[0]
    assert out.finish_reason == "stop" and out.text == full[: full.find(stop)]
    assert len(out.token_ids) < 24


def test_streaming_equals_non_streaming(model):
    params = [l3.SamplingParams(temperature=0.8, top_k=50, seed=11, max_tokens=20, stop=("e ",)),
              l3.SamplingParams(temperature=1.2, seed=12, max_tokens=15, ignore_eos=True)]
    texts = model.generate(PROMPTS, params)
    pieces = {0: [], 1: []}
    for i, delta in model.stream_batch(PROMPTS, params):
        assert delta
        pieces[i].append(delta)
    assert ["".join(pieces[0]), "".join(pieces[1])] == texts
    assert "".join(model.stream(PROMPTS[1], params[1])) == texts[1]
    assert len(pieces[1]) > 1  # it really streamed


def test_token_id_prompts_and_prompt_errors(model):
    ids = model.tokenizer.encode(PROMPTS[0])
    assert model.generate([ids], greedy(5, ignore_eos=True)) == model.generate([PROMPTS[0]], greedy(5, ignore_eos=True))
    with pytest.raises(ValueError, match="empty prompt"):
        model.generate([[]])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 300\)"):
        model.generate([[1, 300]])
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 128"):
        model.generate([PROMPTS[0]], l3.SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match="1 SamplingParams for 2 prompts"):
        model.generate(PROMPTS, [greedy(2)])


def test_benchmark_decode_reports_tokens_per_second(model):
    stats = l3.benchmark_decode(model, batch_size=2, prompt_len=8, new_tokens=6)
    assert stats.generated_tokens == 12 and stats.decode_steps == 5
    assert stats.decode_tokens_per_s > 0 and stats.prefill_tokens_per_s > 0
