"""The triton backend's prefill attention (layer 1's FlashAttention: one prompt, or every
sequence of a step in one varlen launch, reading k/v and writing its output through strided
views, keys after a cached prefix read from the cache in place) against the torch backend, on
fresh random weights at awkward lengths: a batch of fresh prompts, then chunks after cached
prefixes, steps that mix decodes with chunks, cache rows out of order."""
from __future__ import annotations

import pytest
import torch

import layer3_model as l3

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=97, max_position_embeddings=128)


def _pair(seed: int) -> tuple[l3.LlamaModel, l3.LlamaModel]:
    shape = dict(l3.LLAMA_3_2_1B)
    shape.update(SHAPE)
    shape.pop("rope_scaling", None)
    cfg = l3.ModelConfig.from_dict(shape)
    ref = l3.random_model(cfg, backend="torch", seed=seed, std=0.2)
    fast = l3.random_model(cfg, backend="torch", seed=seed, std=0.2)
    fast.set_backend("triton", impl="triton")  # the kernels, through the interpreter on a CPU
    return ref, fast


@pytest.mark.interpreter
@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_then_chunks_match_torch_backend(seed: int) -> None:
    ref, fast = _pair(seed)
    gen = torch.Generator().manual_seed(seed)
    first, second = [5, 13, 1], [4, 7, 3]
    caches = [l3.ContiguousKVCache.for_model(n.config, 3, 40, dtype=torch.float32)
              for n in (ref, fast)]
    with torch.no_grad():
        for lens, done in ((first, [0, 0, 0]), (second, first)):
            ids = torch.randint(0, SHAPE["vocab_size"], (sum(lens),), generator=gen)
            outs = [n(ids, c.context(lens, done), c) for n, c in zip((ref, fast), caches,
                                                                     strict=True)]
            torch.testing.assert_close(outs[1], outs[0], atol=2e-4, rtol=1e-4)


@pytest.mark.interpreter
def test_mixed_steps_in_permuted_rows_match_torch_backend() -> None:
    """Sequences in cache rows [3, 0, 2] (block tables), then a step where two of them decode
    one token while the third brings a chunk: one launch, keys read through the tables."""
    ref, fast = _pair(4)
    gen = torch.Generator().manual_seed(4)
    caches = [l3.ContiguousKVCache.for_model(n.config, 4, 48, dtype=torch.float32)
              for n in (ref, fast)]
    rows, done = [3, 0, 2], [0, 0, 0]
    with torch.no_grad():
        for lens in ([9, 2, 17], [1, 1, 6], [1, 12, 1]):
            ids = torch.randint(0, SHAPE["vocab_size"], (sum(lens),), generator=gen)
            outs = [n(ids, c.context(lens, done, rows), c) for n, c in zip((ref, fast), caches,
                                                                           strict=True)]
            torch.testing.assert_close(outs[1], outs[0], atol=2e-4, rtol=1e-4)
            done = [d + n for d, n in zip(done, lens, strict=True)]


@pytest.mark.interpreter
def test_prefill_without_cache_matches_torch_backend() -> None:
    ref, fast = _pair(3)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(fast.causal_lm_logits(ids), ref.causal_lm_logits(ids),
                                   atol=2e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_bf16_prefill_then_chunks_match_torch_backend() -> None:
    """The compiled kernels in bf16, head_dim 64, lengths that are no multiple of a tile."""
    shape = dict(l3.LLAMA_3_2_1B)
    shape.update(SHAPE, head_dim=64, hidden_size=256, num_attention_heads=8)
    shape.pop("rope_scaling", None)
    cfg = l3.ModelConfig.from_dict(shape)
    nets = [l3.random_model(cfg, backend=b, seed=5, std=0.05, dtype=torch.bfloat16,
                            device="cuda") for b in ("torch", "triton")]
    caches = [l3.ContiguousKVCache.for_model(cfg, 2, 128, dtype=torch.bfloat16, device="cuda")
              for _ in nets]
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for lens, done in (([77, 3], [0, 0]), ([19, 45], [77, 3])):
            ids = torch.randint(0, SHAPE["vocab_size"], (sum(lens),), generator=gen).cuda()
            ref, out = (n(ids, c.context(lens, done), c) for n, c in zip(nets, caches,
                                                                         strict=True))
            err = ((out - ref).norm() / ref.norm()).item()
            assert err < 2e-2, err
