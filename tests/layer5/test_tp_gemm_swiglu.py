"""Layer 5's column-parallel gate_up shard is a plain nn.Linear holding [gate_r; up_r] (rank r's
rows of gate, then the same rows of up), the layout layer 1's gemm_swiglu reads: each rank's
fused mlp_up (LLM_STACK_GEMM_SWIGLU=1, the triton op set) is its columns of the whole model's
silu(gate) * up. CPU: the kernel through Triton's interpreter, fp16, shards of a 2- and 3-way
split built on a one-rank gloo group (no forward, so no collective runs)."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import layer5_parallel as l5
from layer3_model import backends

l3 = l5.engine.executor
TINY = dict(l3.LLAMA_3_2_1B, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=6, head_dim=8, vocab_size=97,
            tie_word_embeddings=False)


@pytest.mark.interpreter
@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_fuses_its_columns_of_gate_up(monkeypatch, world):
    monkeypatch.setenv(backends.GEMM_SWIGLU_ENV, "1")
    calls = []
    original = backends.kernels.gemm_swiglu

    def spy(x, w, **kw):
        calls.append(tuple(w.shape))
        return original(x, w, **kw)

    monkeypatch.setattr(backends.kernels, "gemm_swiglu", spy)
    cfg = l3.ModelConfig.from_dict(TINY)
    net = l3.random_model(cfg, seed=5, std=0.3, dtype=torch.float16)
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))
    x = torch.randn(backends.GEMM_SWIGLU_MIN_ROWS, cfg.hidden_size).half()
    ops = backends.make_ops("triton", impl="triton")
    F = cfg.intermediate_size
    with torch.no_grad():
        whole = backends.torch_silu_and_mul(net.layers[1].mlp.gate_up(x).float())
        for rank in range(world):
            shard = l5.shard_model(net, rank, world, l5.TPComm("torch", pg=pg))
            gate_up = shard.layers[1].mlp.gate_up
            f0, f1 = l5.tensor_parallel.shard.split_bounds(F, world, rank)
            assert type(gate_up) is torch.nn.Linear and gate_up.weight.shape[0] == 2 * (f1 - f0)
            out = ops.mlp_up(x, gate_up)
            torch.testing.assert_close(out.float(), whole[:, f0:f1], atol=2e-3, rtol=2e-3)
    assert len(calls) == world
