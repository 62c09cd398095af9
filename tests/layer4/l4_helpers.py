"""Helpers shared by the layer-4 tests (fixtures live in conftest.py)."""
from __future__ import annotations

import torch

import layer3_model as l3

TINY = dict(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            bos_token_id=0, eos_token_id=1)


def random_prompts(lengths, seed: int = 0, vocab: int = 97) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(max_tokens: int, **kw) -> l3.SamplingParams:
    return l3.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def assert_no_leak(llm) -> None:
    """Every block is free or cached with no references."""
    bm = llm.block_manager
    assert not llm.has_unfinished()
    assert all(r == 0 for r in bm.ref_counts), bm.ref_counts
    assert bm.num_free_blocks == bm.num_blocks


def random_bitmask_case(n: int, r: int, vocab: int, dtype=torch.float32, device="cpu",
                        seed: int = 0):
    """logits (n, vocab), a random (r, W) bitmask (bit 31 set in some words), the r rows it
    masks (distinct, shuffled) and the expected result."""
    from layer4_algorithms.structured import unpack

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g).to(dtype)
    bitmask = torch.randint(-2**31, 2**31 - 1, (r, (vocab + 31) // 32), generator=g,
                            dtype=torch.int64).to(torch.int32)
    rows = torch.randperm(n, generator=g)[:r]
    want = logits.clone()
    want[rows] = want[rows].masked_fill(~unpack(bitmask, vocab), float("-inf"))
    return logits.to(device), bitmask.to(device), rows.to(device), want
