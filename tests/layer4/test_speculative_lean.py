"""The draft's lean single-token step (spec/draft_step.py) against layer 3's serving forward
on fresh random models of awkward shapes (biases, GQA groups of 1 and 3, rows of different
lengths, rows out of order), the proposer's guesses with and without it, and the decoder's
reused draft proposer (one per call shape, every row released between calls)."""
from __future__ import annotations

import pytest
import torch

import layer3_model as l3
from layer4_algorithms.spec.decoder import SpeculativeDecoder
from layer4_algorithms.spec.draft_step import LeanDecodeStep
from layer4_algorithms.spec.proposers import DraftModelProposer

PROMPT = "HAMLET.\nTo be, or not to be, that is the question.\n\nHORATIO.\n"
GREEDY = l3.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _config(**kw) -> l3.ModelConfig:
    base = dict(model_type="llama", vocab_size=203, hidden_size=36, intermediate_size=52,
                num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=10,
                max_position_embeddings=96, rms_norm_eps=1e-5)
    return l3.ModelConfig(**(base | kw))


@pytest.mark.parametrize("kw", [{}, dict(qkv_bias=True, o_bias=True, mlp_bias=True),
                                dict(num_key_value_heads=6, tie_word_embeddings=True),
                                dict(num_attention_heads=3, num_key_value_heads=1, head_dim=14)])
def test_lean_step_matches_the_serving_forward(kw):
    net = l3.random_model(_config(**kw), seed=len(kw), std=0.2)
    gen = torch.Generator().manual_seed(7)
    caches = [l3.ContiguousKVCache.for_model(net.config, 4, 80, dtype=net.dtype) for _ in "ab"]
    lean = LeanDecodeStep(net, caches[1])
    lens = [13, 1, 29, 7]
    with torch.inference_mode():
        for row, n in enumerate(lens):  # prefill every row through the serving forward
            ids = torch.randint(0, 203, (n,), generator=gen)
            for c in caches:
                net(ids, c.context([n], [0], rows=[row]), c, last_only=True)
        for rows in ([0], [2], [0, 1, 2, 3], [3, 0], [1, 2], [2]):
            ids = torch.randint(0, 203, (len(rows),), generator=gen)
            pos = [lens[r] for r in rows]
            ref = net(ids, caches[0].context([1] * len(rows), pos, rows=rows), caches[0],
                      last_only=True)
            out = lean.step(ids, rows, pos)
            for r in rows:
                lens[r] += 1
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(caches[1].k, caches[0].k, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(caches[1].v, caches[0].v, rtol=1e-6, atol=1e-6)


def test_static_forward_over_every_slot_matches_the_serving_forward():
    """What LeanGraphStep captures: attention over all max_len slots of rows 0..B-1, later
    slots masked by position (stale values there must not leak in)."""
    net = l3.random_model(_config(num_attention_heads=4, num_key_value_heads=2), seed=5,
                          std=0.2)
    caches = [l3.ContiguousKVCache.for_model(net.config, 3, 32, dtype=net.dtype) for _ in "ab"]
    caches[0].k.normal_()  # the same garbage in both caches' unwritten slots
    caches[0].v.normal_()
    caches[1].k.copy_(caches[0].k)
    caches[1].v.copy_(caches[0].v)
    lean = LeanDecodeStep(net, caches[1])
    gen = torch.Generator().manual_seed(2)
    slots = torch.arange(32)
    with torch.inference_mode():
        for pos in ([0, 5, 2], [1, 6, 3], [2, 7, 4]):
            ids = torch.randint(0, 203, (3,), generator=gen)
            p = torch.tensor(pos)
            ref = net(ids, caches[0].context([1] * 3, pos), caches[0], last_only=True)
            mask = (slots[None, :] <= p[:, None])[:, None, None, :]
            out = lean.forward(ids, p, torch.arange(3) * 32 + p, 32, mask, None)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_lean_step_in_bf16_is_close():
    net = l3.random_model(_config(), seed=4, std=0.2, dtype=torch.bfloat16)
    caches = [l3.ContiguousKVCache.for_model(net.config, 1, 24, dtype=net.dtype) for _ in "ab"]
    lean = LeanDecodeStep(net, caches[1], half=True)  # half: only for an fp32 model
    assert lean.lm_head.dtype == torch.bfloat16
    with torch.inference_mode():
        for pos in range(6):
            ids = torch.tensor([pos * 31 % 203])
            ref = net(ids, caches[0].context([1], [pos]), caches[0], last_only=True)
            torch.testing.assert_close(lean.step(ids, [0], [pos]), ref, rtol=5e-2, atol=1e-1)


def test_lean_step_with_half_weights_is_close_and_writes_fp32_cache():
    net = l3.random_model(_config(qkv_bias=True, mlp_bias=True), seed=3, std=0.2)
    caches = [l3.ContiguousKVCache.for_model(net.config, 2, 40, dtype=net.dtype) for _ in "ab"]
    half = LeanDecodeStep(net, caches[1], half=True)
    assert half.lm_head.dtype == torch.float16 and caches[1].k.dtype == torch.float32
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for pos in range(12):
            ids = torch.randint(0, 203, (2,), generator=gen)
            ref = net(ids, caches[0].context([1, 1], [pos, pos]), caches[0], last_only=True)
            out = half.step(ids, [0, 1], [pos, pos])
            assert out.dtype == torch.float32
            torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_lean_step_refuses_what_it_does_not_cover():
    for kw, why in ((dict(qk_norm=True), "q/k RMSNorm"),
                    (dict(layer_windows=(None, 8, None)), "sliding-window")):
        net = l3.random_model(_config(**kw))
        cache = l3.ContiguousKVCache.for_model(net.config, 1, 16, dtype=net.dtype)
        with pytest.raises(ValueError, match=why):
            LeanDecodeStep(net, cache)
        assert DraftModelProposer(net, 1, 16)._lean is None  # the serving forward instead
    net = l3.random_model(_config())
    lean = LeanDecodeStep(net, l3.ContiguousKVCache.for_model(net.config, 1, 16,
                                                              dtype=net.dtype))
    with pytest.raises(ValueError, match="past the draft cache"):
        lean.step(torch.tensor([1]), [0], [16])


def _rounds(draft: l3.Model, prop: DraftModelProposer) -> list[list[int]]:
    """Guesses over rounds with rejections and full accepts (the cache rolls back itself)."""
    seq, out = list(draft.encode(PROMPT)), []
    for accept in (0, 4, 2, 4, 1, 3):
        p = prop.propose([seq], [0], [4], [GREEDY], [None])
        out.append(p.tokens[0].tolist())
        bonus = (out[-1][accept] + 1) % 4096 if accept < 4 else 17
        seq = seq + out[-1][:accept] + [bonus]
    return out


def test_lean_draft_guesses_like_the_serving_forward(draft):
    plain = DraftModelProposer(draft.net, 1, 128, lean=False)
    lean = DraftModelProposer(draft.net, 1, 128)
    assert _rounds(draft, lean) == _rounds(draft, plain)
    assert plain.lean_steps == 0 and plain.steps == 6 * 4
    # every step lean but the prompt's; catch-ups of 1 (rejection) or 2 (full accept) tokens
    # are fed as steps: 3 + (1+3) + (2+3) + (1+3) + (2+3) + (1+3)
    assert lean.lean_steps == 3 + 4 + 5 + 4 + 5 + 4 and lean.steps == lean.lean_steps + 1


def test_decoder_reuses_its_draft_proposer_with_rows_released(target, draft):
    params = l3.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = target.generate_outputs([PROMPT], params)[0].token_ids
    dec = SpeculativeDecoder(target, draft, 3)
    first = dec.generate([PROMPT], params)[0].token_ids
    prop, steps = dec._draft_prop, dec.stats.draft_steps
    second = dec.generate([PROMPT], params)[0].token_ids
    assert first == second == ref
    assert dec._draft_prop is prop and dec.stats.draft_steps == steps  # counts per call
    dec.generate([PROMPT, "ROMEO.\n"], params)  # another shape: a new proposer
    assert dec._draft_prop is not prop
