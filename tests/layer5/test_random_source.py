"""Random-weight benchmarks start cheaply: every rank draws the same random weights itself
from one seed (runtime/random_source.py) instead of receiving rank 0's tensors; a TP=2 engine
over such a net (gloo) gives TP=1's greedy tokens."""
from __future__ import annotations

import torch

import layer5_parallel as l5
from layer5_parallel.runtime.random_source import random_net
from layer5_parallel.runtime.worker import load_full

l3 = l5.engine.executor
CONFIG = l3.ModelConfig(model_type="llama", vocab_size=101, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, max_position_embeddings=64, tie_word_embeddings=True)


def test_the_same_seed_draws_the_same_net_and_workers_redraw_it():
    a = random_net(CONFIG, dtype=torch.float32, seed=3, std=0.3)
    b = load_full(a.worker_source, torch.device("cpu"))
    assert a.worker_source[0] == "random"
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert b.lm_head.weight is b.embed.weight  # tied, as rank 0's
    c = random_net(CONFIG, dtype=torch.float32, seed=4, std=0.3)
    assert not torch.equal(c.embed.weight, a.embed.weight)


def test_tp2_over_a_random_net_gives_tp1_tokens():
    model = l3.Model(random_net(CONFIG, dtype=torch.float32, seed=1, std=0.3))
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    params = l5.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(num_blocks=32, block_size=8, max_num_seqs=4)
    want = [o.outputs[0].token_ids for o in l5.LLM(model, **kw).generate(prompts, params)]
    with l5.LLM(model, tensor_parallel_size=2, tp_timeout_s=60, tp_threads=1, **kw) as tp:
        got = [o.outputs[0].token_ids for o in tp.generate(prompts, params)]
    assert got == want
