"""Tensor parallelism through the engine: TP=2 and TP=4 greedy output equals TP=1.

Gloo ranks on the CPU, fp32. A token may differ from TP=1 only where TP=1's own top two
logits nearly tie (the all-reduce sums in another order, so logits move by ~1e-6): the test
shows that margin. One LLM per tp size (its worker processes start once), few tokens.
"""
from __future__ import annotations

import dataclasses
import multiprocessing

import pytest
import torch

import layer5_parallel as l5

from .engine_checks import assert_all_same_or_near_tie

l3 = l5.engine.executor
PROMPTS = [
    "ROMEO.\n", "JULIET.\nO Romeo, Romeo", "HAMLET.\nTo be, or not to be", "KING LEAR.\n",
    "MACBETH.\nIs this a dagger", "PORTIA.\nThe quality of mercy", "OTHELLO.\n", "IAGO.\nI am not",
    "PUCK.\nIf we shadows", "LADY MACBETH.\nOut, damned", "BRUTUS.\n", "CASSIUS.\nThe fault",
    "PROSPERO.\nWe are such stuff", "VIOLA.\n", "FALSTAFF.\nThe better part", "HAL.\nI know you",
]
MAX_TOKENS = 8
LOGIT_ATOL = 1e-3


def random_config() -> l3.ModelConfig:
    """Awkward sizes: vocab 211 and FFN 90 split unevenly over 4 ranks; 8 query heads, 2 kv heads
    (replicated at tp=4), qkv bias."""
    return l3.ModelConfig(model_type="qwen2", vocab_size=211, hidden_size=64, intermediate_size=90,
                          num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=8, qkv_bias=True, max_position_embeddings=128)


def random_prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 21, (n,), generator=g).tolist()
    return [torch.randint(0, 211, (k,), generator=g).tolist() for k in lens]


def run(llm, prompts) -> dict:
    """Greedy tokens of every prompt, and the fp32 logits of prompt + tokens (one prefill)."""
    params = l5.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params)
    ids = [llm.model.encode(p) for p in prompts]
    tokens = [o.outputs[0].token_ids for o in outs]
    return {"ids": ids, "tokens": tokens, "llm": llm}


@pytest.fixture(scope="module")
def course():
    """TP=1 (layer 4's engine, in this process) and TP=2 on the course model, fp32."""
    d = l3.course_model_dir("target")
    ref = l5.LLM(d, tensor_parallel_size=1, dtype="float32", num_blocks=64)
    r1 = run(ref, PROMPTS)
    seqs = [i + t for i, t in zip(r1["ids"], r1["tokens"], strict=True)]
    r1["logits"] = ref.prompt_logits(seqs)
    with l5.LLM(d, tensor_parallel_size=2, dtype="float32", num_blocks=64) as tp:
        r2 = run(tp, PROMPTS)
        r2["logits"] = tp.prompt_logits(seqs)
        r2["memory"] = tp.rank_memory()
    return r1, r2


@pytest.fixture(scope="module")
def random4():
    """A random qwen2-shaped model (kv_heads=2) at TP=1 and TP=4, over layer 2's collectives."""
    net = l3.random_model(random_config(), seed=1, std=0.3)
    model = l3.Model(net)
    prompts = random_prompts()
    r1 = run(l5.LLM(model, tensor_parallel_size=1, num_blocks=64, block_size=8), prompts)
    seqs = [i + t for i, t in zip(r1["ids"], r1["tokens"], strict=True)]
    r1["logits"] = r1["llm"].prompt_logits(seqs)
    with l5.LLM(model, tensor_parallel_size=4, num_blocks=64, block_size=8,
                tp_backend="ours") as tp:
        r4 = run(tp, prompts)
        r4["logits"] = tp.prompt_logits(seqs)
        r4["memory"] = tp.rank_memory()
    return r1, r4


def test_tp1_is_layer4_engine_in_this_process(course):
    ref, _ = course
    # layer 4's engine, stepping as layer 4 does: layer 5's step() is its own only with
    # pipeline steps in flight (lanes), which TP=1 has not
    assert isinstance(ref["llm"], l5.engine.LLM) and ref["llm"].lanes is None
    assert ref["llm"].tp_group is None
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("l5-rank")]


def test_tp2_course_model_matches_tp1(course):
    ref, tp = course
    assert_all_same_or_near_tie(ref, tp)
    for a, b in zip(ref["logits"], tp["logits"], strict=True):
        torch.testing.assert_close(b, a, atol=LOGIT_ATOL, rtol=0)


def test_tp2_holds_half_the_heads_per_rank(course):
    ref, tp = course
    mem = tp["memory"]
    assert [m["rank"] for m in mem] == [0, 1]
    assert mem[0]["kv"] == mem[1]["kv"] == ref["llm"].cache.nbytes // 2  # 2 kv heads -> 1 per rank
    full = l3.load(l3.course_model_dir("target"), dtype="float32").net
    total = sum(p.numel() * 4 for p in full.parameters())
    norms = sum(p.numel() * 4 for n, p in full.named_parameters() if n.endswith("norm.weight"))
    # everything is split in half but the norms, which every rank holds whole
    assert mem[0]["weights"] == mem[1]["weights"] == (total - norms) // 2 + norms


def test_tp4_random_kv2_matches_tp1(random4):
    ref, tp = random4
    assert_all_same_or_near_tie(ref, tp)
    for a, b in zip(ref["logits"], tp["logits"], strict=True):
        torch.testing.assert_close(b, a, atol=LOGIT_ATOL, rtol=0)
    # kv heads replicated: each rank's cache holds 1 of the 2 kv heads
    assert all(m["kv"] == ref["llm"].cache.nbytes // 2 for m in tp["memory"])


def test_tp_that_does_not_divide_heads_names_valid_sizes():
    with pytest.raises(ValueError, match=r"valid sizes: 1, 2, 6"):
        l5.LLM(l3.course_model_dir("target"), tensor_parallel_size=4, dtype="float32", num_blocks=8)
    assert l5.valid_tp_sizes(random_config()) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="positive int"):
        l5.LLM(l3.course_model_dir("target"), tensor_parallel_size=0)


def test_tp_rank0_model_pads_prefill_as_its_shard_does(course):
    """Layer 4's runner cuts a mixed step into passes only where the model's attention pads
    (pads_prefill_attention reads net.ops): rank 0's TP model must answer as its shard."""
    model = course[1]["llm"].model.net
    shard, own = model.shard, model.shard.ops
    try:
        for name in ("torch", "triton"):
            shard.ops = dataclasses.replace(own, name=name)
            assert l3.pads_prefill_attention(model) == l3.pads_prefill_attention(shard)
        assert not l3.pads_prefill_attention(model)  # triton at head_dim 64: nothing pads
    finally:
        shard.ops = own
