"""Penalties and logprobs in layer 4: the engine against plain references computed on the
model's logits (one no-cache forward of the whole sequence), and the params' validation."""
from __future__ import annotations

import pytest
import torch

import layer3_model as l3
from layer4_algorithms import LLM, SamplingParams
from layer4_algorithms.logits_processing import apply_penalties, token_logprobs

from .l4_helpers import greedy, random_prompts


def full_logits(model: l3.Model, ids: list[int]) -> torch.Tensor:
    """(L, V) fp32 logits of every position of ids, no KV cache: the reference."""
    net = model.net
    ctx = l3.AttentionContext.build([len(ids)], [0], torch.zeros(len(ids), dtype=torch.int64),
                                    device=net.device)
    with torch.no_grad():
        return net(torch.tensor(ids), ctx, None).float()


def reference_penalized(model, prompt, n, presence, frequency) -> list[int]:
    """Greedy decoding with OpenAI's penalties applied by hand to the last row each step."""
    out: list[int] = []
    for _ in range(n):
        row = full_logits(model, prompt + out)[-1].clone()
        for t in set(out):
            row[t] -= frequency * out.count(t) + presence
        out.append(int(row.argmax()))
    return out


def test_penalties_match_a_reference(tiny_model):
    prompts = random_prompts([5, 9], seed=3)
    llm = LLM(tiny_model, num_blocks=64, block_size=4)
    params = [greedy(12, presence_penalty=0.7, frequency_penalty=1.5), greedy(12)]
    outs = llm.generate(prompts, params)
    assert outs[0].outputs[0].token_ids == reference_penalized(tiny_model, prompts[0], 12, .7, 1.5)
    assert outs[1].outputs[0].token_ids == reference_penalized(tiny_model, prompts[1], 12, 0, 0)
    assert outs[1].outputs[0].logprobs is None  # nobody asked


def test_logprobs_are_log_softmax_of_the_reference_logits(tiny_model):
    prompt = random_prompts([7], seed=5)[0]
    llm = LLM(tiny_model, num_blocks=64, block_size=4)
    sp = SamplingParams(temperature=0.9, seed=1, max_tokens=10, ignore_eos=True, logprobs=3)
    c = llm.generate([prompt], sp)[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 10
    ref = torch.log_softmax(full_logits(tiny_model, prompt + c.token_ids), dim=-1)
    for j, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + j]
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(float(row[tok]), abs=1e-4)
        vals, ids = row.topk(3)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-4)


def test_logprobs_stop_at_eos_and_zero_top(tiny_model):
    """An EOS ends the completion and is not an output token: no logprob entry for it."""
    prompt = random_prompts([6], seed=2)[0]
    plain = LLM(tiny_model, num_blocks=64, block_size=4).generate(
        [prompt], greedy(8))[0].outputs[0].token_ids
    eos = plain[3]  # pretend the 4th token is EOS: the output stops before it
    model = l3.Model(tiny_model.net, None)
    model.eos_token_ids = (eos,)
    llm = LLM(model, num_blocks=64, block_size=4)
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
    c = llm.generate([prompt], sp)[0].outputs[0]
    assert c.finish_reason == "eos" and len(c.logprobs) == len(c.token_ids)
    assert all(lp.top == [] for lp in c.logprobs)


def test_helpers_on_hand_made_logits():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
    p = [SamplingParams(presence_penalty=0.5, frequency_penalty=1.0), SamplingParams()]
    got = apply_penalties(logits, p, [[3, 3, 1], [0]])
    assert torch.equal(got, torch.tensor([[0.0, -0.5, 2.0, 0.5], [1.0, 1.0, 1.0, 1.0]]))
    assert torch.equal(logits[0], torch.tensor([0.0, 1.0, 2.0, 3.0]))  # input untouched
    lps = token_logprobs(got, [2, 0], [2, None])
    ref = torch.log_softmax(got[0], -1)
    assert lps[1] is None and lps[0].token_id == 2
    assert lps[0].logprob == pytest.approx(float(ref[2]))
    assert [t for t, _ in lps[0].top] == [2, 3]


@pytest.mark.parametrize("bad, word", [(dict(presence_penalty=2.5), "presence_penalty"),
                                       (dict(frequency_penalty="x"), "frequency_penalty"),
                                       (dict(logprobs=-1), "logprobs"),
                                       (dict(logprobs=21), "logprobs"),
                                       (dict(logprobs=True), "logprobs")])
def test_bad_params_are_named(bad, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**bad)
