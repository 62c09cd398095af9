"""A tiny MoE transformer of Mixtral's / Qwen-MoE's shape (random weights), and its EP forward.

Each layer: x + Attn(RMSNorm(x)) (grouped-query attention, causal), then x + MoE(RMSNorm(x)),
with Qwen-MoE's optional shared expert (a dense SwiGLU every token goes through, scaled by a
sigmoid gate) beside the routed ones. No rotary embedding: positions change nothing about how
the experts are split, which is what this model is for.

Expert parallelism in a model (`ExpertParallelModel`): the batch's sequences are split over
the ranks (attention is data-parallel: it needs whole sequences, and its weights are small
and replicated), and every MoE layer is an `ExpertParallelMoE` over the same ranks, holding
E/N of that layer's experts. DeepSeek-V3 and vLLM's "DP attention + EP" serve MoE models this
way. Through layer 4's engine (paged KV, continuous batching), with attention TP-sharded and
the experts split over the same ranks, the MoE model is engine_model.py's (a layer-3-style model).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import layer4_algorithms as engine

from .experts import ExpertParallelMoE
from .moe import MoEBlock, MoEStats, stats_of, swiglu

comm = engine.comm


@dataclass(frozen=True)
class MoEConfig:
    """Shapes of a tiny MoE model. shared_ffn > 0 adds a shared expert (Qwen-MoE)."""

    vocab: int = 101
    hidden: int = 32  # D, the model width
    layers: int = 2
    heads: int = 4  # query heads
    kv_heads: int = 2  # key/value heads (grouped-query attention)
    expert_ffn: int = 24  # each expert's SwiGLU width
    experts: int = 8  # E, routed experts per MoE layer
    k: int = 2  # experts each token is routed to (top-k)
    capacity_factor: float | None = None  # per-expert limit ceil(factor * T * k / E); None: none
    shared_ffn: int = 0


MIXTRAL_TINY = MoEConfig(experts=8, k=2)  # Mixtral-8x7B: 8 experts, top-2, no shared expert
# Qwen1.5-MoE-A2.7B: 60 experts, top-4, and a shared expert
QWEN_MOE_TINY = MoEConfig(experts=12, k=4, expert_ffn=16, shared_ffn=48)


class MoELayer(nn.Module):
    def __init__(self, c: MoEConfig, g: torch.Generator) -> None:
        super().__init__()
        D, hd = c.hidden, c.hidden // c.heads

        def w(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=g) / math.sqrt(shape[-1]))

        self.c = c
        self.wq, self.wk, self.wv = w(c.heads * hd, D), w(c.kv_heads * hd, D), w(c.kv_heads * hd, D)
        self.wo = w(D, c.heads * hd)
        self.norm1, self.norm2 = nn.Parameter(torch.ones(D)), nn.Parameter(torch.ones(D))
        self.moe = MoEBlock(D, c.expert_ffn, c.experts, c.k, c.capacity_factor, generator=g)
        if c.shared_ffn:
            self.shared = nn.ParameterList([w(c.shared_ffn, D), w(c.shared_ffn, D),
                                            w(D, c.shared_ffn), w(1, D)])

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        c, hd = self.c, D // self.c.heads
        h = F.rms_norm(x, (D,), self.norm1, 1e-6)
        q = (h @ self.wq.T).view(B, S, c.heads, hd).transpose(1, 2)
        k = (h @ self.wk.T).view(B, S, c.kv_heads, hd).transpose(1, 2)
        v = (h @ self.wv.T).view(B, S, c.kv_heads, hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return x + a.transpose(1, 2).reshape(B, S, -1) @ self.wo.T

    def ffn(self, x: torch.Tensor, routed) -> tuple[torch.Tensor, MoEStats]:
        """x (B, S, D); routed: flat (T, D) -> ((T, D), MoEStats), the MoE (local or EP)."""
        h = F.rms_norm(x, (x.shape[-1],), self.norm2, 1e-6).reshape(-1, x.shape[-1])
        y, stats = routed(h)
        if self.c.shared_ffn:
            wg, wu, wd, gate = self.shared
            y = y + torch.sigmoid(h @ gate.T) * swiglu(h, wg, wu, wd)
        return x + y.view_as(x), stats


class MoETransformer(nn.Module):
    """forward(tokens (B, S) int64) -> (logits (B, S, vocab), [MoEStats per layer])."""

    def __init__(self, c: MoEConfig, seed: int = 0) -> None:
        super().__init__()
        if c.hidden % c.heads or c.heads % c.kv_heads:
            raise ValueError(f"hidden {c.hidden} must divide by heads {c.heads}, and heads by "
                             f"kv_heads {c.kv_heads}")
        g = torch.Generator().manual_seed(seed)
        self.c = c
        self.embed = nn.Parameter(torch.randn(c.vocab, c.hidden, generator=g))
        self.layers = nn.ModuleList(MoELayer(c, g) for _ in range(c.layers))
        self.norm = nn.Parameter(torch.ones(c.hidden))

    def _local(self, layer: MoELayer):
        def routed(h: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:
            y, routing = layer.moe(h)
            return y, stats_of(routing, layer.moe.num_experts)
        return routed

    def forward(self, tokens: torch.Tensor, routed: list | None = None):
        x = self.embed[tokens]
        stats = []
        for i, layer in enumerate(self.layers):
            x, st = layer.ffn(layer.attention(x), routed[i] if routed else self._local(layer))
            stats.append(st)
        return F.rms_norm(x, (x.shape[-1],), self.norm, 1e-6) @ self.embed.T, stats


class ExpertParallelModel:
    """This rank's view of a MoETransformer under EP: every MoE layer holds E/N experts.

    forward(tokens_r (B_r, S)) -> (logits (B_r, S, vocab), [MoEStats of the whole batch]);
    ranks hold contiguous groups of sequences (`comm.segment_bounds(B, N)[rank]`), every rank
    calls it together. (The replicated parts are kept whole here: a real deployment would free
    the other ranks' experts, which ExpertParallelMoE copies out of the full block.)
    """

    def __init__(self, model: MoETransformer) -> None:
        self.model = model
        self.ep = [ExpertParallelMoE(layer.moe) for layer in model.layers]

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor):
        return self.model(tokens, routed=[ep.forward for ep in self.ep])

    __call__ = forward
