"""Lab 3's answers, made of layer3_model's own code: what plain `pytest` grades (the
`impl` fixture gives tests/labs/test_lab3.py the layer package, which maps it to this
module) and what `lab3.ipynb` runs with LLM_STACK_LAB_REFERENCE=1.

Each exercise is the layer's implementation behind the lab's simpler signature:
* rms_norm, apply_rope: the "torch" backend's ops (`layer3_model.make_ops("torch")`), with
  the RoPE frequencies from `ModelConfig.rope_inv_freq` (the code LlamaModel uses).
* gqa_attention: the backend's attention over an `AttentionContext`, reading and writing
  the caller's cache tensors through the `KVCache` protocol (the seam layer 4's paged
  cache plugs into).
* top_p_filter, top_p_sample: `layer3_model.top_p_filter` and `layer3_model.sample`.

Reading it gives nothing away that layer3_model does not: it is the answer key all the same,
and a submission that imports it earns nothing.
"""
from __future__ import annotations

import math

import torch

import layer3_model as l3

_OPS = l3.make_ops("torch")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return _OPS.rms_norm(x, weight, eps)


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    # A one-layer config only to reach the layer's frequency code (the same arithmetic,
    # bit for bit, as the tables LlamaModel builds).
    config = l3.ModelConfig(
        model_type="llama", vocab_size=1, hidden_size=head_dim, intermediate_size=1,
        num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=head_dim,
        rope_theta=float(theta),
    )
    return config.rope_inv_freq()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    angles = torch.outer(positions.to(torch.float32), _inv_freq(x.shape[-1], theta))  # (T, D/2)
    rows = torch.arange(x.shape[0], device=x.device)  # the tables are already per token
    rotated, _ = _OPS.rope(x, x[:, :1], angles.cos().to(x.device), angles.sin().to(x.device), rows)
    return rotated


class _SequenceCache:
    """layer3_model's KVCache protocol over one sequence's (max_len, Hkv, D) tensors."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k, self.v = k_cache, v_cache

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, ctx: l3.AttentionContext) -> None:
        self.k.index_copy_(0, ctx.slot_mapping, k.to(self.k.dtype))
        self.v.index_copy_(0, ctx.slot_mapping, v.to(self.v.dtype))

    def read(self, layer: int, ctx: l3.AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        n = ctx.max_seq_len  # (1, Hkv, n, D): a batch of one, right-padded to nothing
        return self.k[:n].transpose(0, 1)[None], self.v[:n].transpose(0, 1)[None]


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, start: int, scale: float | None = None) -> torch.Tensor:
    T, _, D = q.shape
    if start + T > k_cache.shape[0]:
        raise ValueError(f"{start + T} tokens do not fit a cache of {k_cache.shape[0]} rows")
    cache = _SequenceCache(k_cache, v_cache)
    ctx = l3.AttentionContext.build([T], [start], torch.arange(start, start + T), device=q.device)
    cache.write(0, k, v, ctx)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    return _OPS.attention(q, k, v, ctx, cache, 0, scale, None)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    return l3.top_p_filter(logits, p)


def top_p_sample(logits: torch.Tensor, p: float = 1.0, temperature: float = 1.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    params = [l3.SamplingParams(temperature=temperature, top_p=p)] * logits.shape[0]
    return l3.sample(logits, params, [generator] * logits.shape[0])
