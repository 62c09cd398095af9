"""Prefill's host-lean paths against the plain ones, on fresh random
weights at awkward lengths: RoPE fused with the KV-cache write (bit for bit), and batch-1
prefill replayed from a CUDA graph per prompt-length bucket."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import layer3_model as l3
from layer3_model.prefill_graph import CudaGraphPrefill

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=97, max_position_embeddings=256)


def small_config(**over) -> l3.ModelConfig:
    """The 1B's config at SHAPE's sizes (and `over`): a small Llama with the real one's rest."""
    shape = dict(l3.LLAMA_3_2_1B)
    shape.update(SHAPE, **over)
    shape.pop("rope_scaling", None)
    return l3.ModelConfig.from_dict(shape)


def _net(seed: int, dtype=torch.float32, device="cpu", **over) -> l3.LlamaModel:
    net = l3.random_model(small_config(**over), backend="torch", seed=seed, std=0.2,
                          dtype=dtype, device=device)
    net.set_backend("triton", impl="triton" if device == "cpu" else "auto")
    return net


def _fused_vs_unfused(net: l3.LlamaModel, device: str, dtype: torch.dtype, exact: bool) -> None:
    """The same prefill, then a chunk after it, with ops.rope_write and without: equal logits
    and caches (the fused kernel computes what rope + index_copy_ do; exact: bit for bit, as
    the interpreter runs it; on a GPU the two kernels' compilers may contract the rotation's
    multiply-adds differently, so within bf16 rounding there)."""
    fused = net.ops
    assert fused.rope_write is not None
    caches = [l3.ContiguousKVCache.for_model(net.config, 3, 48, dtype=dtype, device=device)
              for _ in range(2)]
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for lens, done in (([5, 13, 1], [0, 0, 0]), ([4, 7, 3], [5, 13, 1])):
            ids = torch.randint(0, SHAPE["vocab_size"], (sum(lens),), generator=gen).to(device)
            outs = []
            for ops, cache in zip((fused, dataclasses.replace(fused, rope_write=None)), caches,
                                  strict=True):
                net.ops = ops
                outs.append(net(ids, cache.context(lens, done), cache))
            net.ops = fused
            if exact:
                assert torch.equal(outs[0], outs[1])
            else:
                assert ((outs[0] - outs[1]).norm() / outs[1].norm()).item() < 2e-2
    for a, b in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.interpreter
def test_rope_write_fused_equals_unfused_interpreted() -> None:
    _fused_vs_unfused(_net(0), "cpu", torch.float32, exact=True)


@pytest.mark.gpu
def test_rope_write_fused_equals_unfused_gpu_bf16() -> None:
    _fused_vs_unfused(_net(1, torch.bfloat16, "cuda", head_dim=64, hidden_size=256,
                           num_attention_heads=8), "cuda", torch.bfloat16, exact=False)


def test_graph_prefill_needs_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the error where no CUDA GPU is visible")
    net = _net(0)
    cache = l3.ContiguousKVCache.for_model(net.config, 1, 64, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="CUDA"):
        CudaGraphPrefill(net, cache)


@pytest.mark.gpu
def test_graph_prefill_matches_eager_at_awkward_lengths() -> None:
    """Prompts of 1, 37, 64 (a bucket exactly), 100 tokens into rows 0 and 1: the graph's
    last-token logits and cache rows match an eager prefill's within bf16 rounding (GEMMs of
    the bucket's height may pick other cuBLAS kernels than the prompt's)."""
    net = _net(2, torch.bfloat16, "cuda", head_dim=64, hidden_size=256, num_attention_heads=8)
    cfg = net.config
    graphs_cache = l3.ContiguousKVCache.for_model(cfg, 2, 160, dtype=torch.bfloat16,
                                                  device="cuda")
    eager_cache = l3.ContiguousKVCache.for_model(cfg, 2, 160, dtype=torch.bfloat16,
                                                 device="cuda")
    g = CudaGraphPrefill(net, graphs_cache, buckets=(64, 128, 512))
    assert g.buckets == (64, 128)  # 512 > the cache's 160 slots per row: dropped
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, row in ((37, 0), (64, 1), (1, 1), (100, 0)):
            ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen).cuda()
            got = g.prefill(ids, row)
            ctx = eager_cache.context([n], [0], rows=[row])
            want = net(ids, ctx, eager_cache, last_only=True)[0]
            assert got.shape == (cfg.vocab_size,) and got.dtype == torch.float32
            err = ((got - want).norm() / want.norm()).item()
            assert err < 2e-2, (n, err)
            for mine, ref in ((graphs_cache.k, eager_cache.k), (graphs_cache.v, eager_cache.v)):
                torch.testing.assert_close(mine[:, row, :n], ref[:, row, :n], atol=2e-2,
                                           rtol=2e-2)
    with pytest.raises(ValueError, match="largest bucket"):
        g.prefill(torch.zeros(129, dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match="row"):
        g.prefill(torch.zeros(3, dtype=torch.int64, device="cuda"), row=2)
