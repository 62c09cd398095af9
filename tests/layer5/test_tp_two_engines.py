"""Two tensor-parallel engines in one process (`stack serve --tp 2` with two models): each owns
its process group (its own TCPStore and gloo backend, not torch.distributed's default group),
so they start, generate alternately, and close independently; outputs equal TP=1's.
"""
from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.distributed as dist

import layer5_parallel as l5
from layer5_parallel.expert_parallel.engine_model import moe_config, random_moe_model

l3 = l5.engine.executor
PARAMS = l5.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def dense_model() -> l3.Model:
    config = l3.ModelConfig(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=44,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, max_position_embeddings=64)
    return l3.Model(l3.random_model(config, seed=3, std=0.3))


def prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist()
            for k in torch.randint(2, 15, (n,), generator=g)]


def tokens(llm, ps) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(ps, PARAMS)]


def test_two_tp2_engines_in_one_process_alternate():
    a_model, b_model = dense_model(), l3.Model(random_moe_model(moe_config(), seed=4))
    a_prompts = [prompts(97, 5, s) for s in (0, 1)]
    b_prompts = [prompts(211, 5, s) for s in (2, 3)]
    want_a = [tokens(l5.LLM(a_model, num_blocks=32, block_size=4), p) for p in a_prompts]
    want_b = [tokens(l5.LLM(b_model, num_blocks=32, block_size=4), p) for p in b_prompts]
    a = l5.LLM(a_model, tensor_parallel_size=2, num_blocks=32, block_size=4)
    b = l5.LLM(b_model, tensor_parallel_size=2, enable_expert_parallel=True, num_blocks=32,
               block_size=4)
    try:
        assert a.tp_group.comm.pg is not b.tp_group.comm.pg
        assert not dist.is_initialized()  # neither took torch.distributed's default group
        got_a, got_b = [], []
        for pa, pb in zip(a_prompts, b_prompts, strict=True):  # alternate: a, b, a, b
            got_a.append(tokens(a, pa))
            got_b.append(tokens(b, pb))
        a.close()  # one closes; the other goes on
        got_b.append(tokens(b, b_prompts[0]))
        with pytest.raises(RuntimeError, match="is closed"):
            tokens(a, a_prompts[0])
    finally:
        a.close()
        b.close()
    assert got_a == want_a
    assert got_b == [*want_b, want_b[0]]
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("l5-rank")]
