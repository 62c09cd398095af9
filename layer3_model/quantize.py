"""Weight-only int8 quantization (W8A16) and perplexity, to see what it costs in quality.

Decode is memory-bound: each step reads every weight once to multiply it by a handful of
activation rows. Storing weights as int8 with one scale per output channel halves the
bytes of a bf16 weight (quarters fp32), so a bandwidth-bound step gets up to ~2x faster.
Activations stay in 16 (or 32) bits: layer 1's kernel dequantizes each weight tile in
registers, w = w_int8 * scale[n], and accumulates in fp32.

Quality: per-channel symmetric rounding errs by at most scale/2 = max|w_row| / 254 per
weight. perplexity() = exp(mean next-token cross-entropy) on a token sequence, so the
quantized and unquantized models can be compared on the same text (lower is better).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from layer2_comm import kernels

from .model import LlamaModel


class Int8Linear(nn.Module):
    """y = x @ (w_int8 * scale[:, None])^T (+ bias). w_int8 (N, K) int8, scale (N,) in the
    activation dtype; x (..., K) -> (..., N) through layer 1's int8_matmul (impl: "auto" =
    Triton on CUDA, torch reference on CPU)."""

    def __init__(self, linear: nn.Linear, *, impl: str = "auto") -> None:
        super().__init__()
        w_int8, scale = kernels.quantize_int8(linear.weight.detach())
        self.register_buffer("w_int8", w_int8)
        self.register_buffer("scale", scale)
        self.bias = (
            None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        )
        self.in_features, self.out_features, self.impl = (
            linear.in_features,
            linear.out_features,
            impl,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = kernels.int8_matmul(
            x.reshape(-1, self.in_features), self.w_int8, self.scale, impl=self.impl
        )
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def quantize_model(
    model: LlamaModel, *, include_lm_head: bool = False, impl: str = "auto"
) -> LlamaModel:
    """Replace the decoder's nn.Linear layers (qkv, o_proj, gate_up, down) with Int8Linear,
    in place. The LM head stays in full precision unless include_lm_head (and never when it
    is tied to the embedding, which must stay a float table). Returns the model."""
    for layer in model.layers:
        layer.attn.qkv = Int8Linear(layer.attn.qkv, impl=impl)
        layer.attn.o_proj = Int8Linear(layer.attn.o_proj, impl=impl)
        layer.mlp.gate_up = Int8Linear(layer.mlp.gate_up, impl=impl)
        layer.mlp.down = Int8Linear(layer.mlp.down, impl=impl)
    if include_lm_head and not model.config.tie_word_embeddings:
        model.lm_head = Int8Linear(model.lm_head, impl=impl)
    return model


def weight_bytes(model: LlamaModel) -> int:
    """Bytes of parameters and int8 buffers (what a decode step streams), tied weights once."""
    seen, total = set(), 0
    for t in list(model.parameters()) + [
        b for n, b in model.named_buffers() if n.endswith(("w_int8", "scale"))
    ]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    return total


@torch.no_grad()
def perplexity(
    model, token_ids: Sequence[int] | torch.Tensor, *, window: int | None = None
) -> float:
    """exp(mean cross-entropy of predicting token t+1 from tokens <= t) over token_ids (N,).
    `model`: a LlamaModel or a Model from load(). Texts longer than `window` (default:
    max_position_embeddings) are scored in independent windows."""
    net: LlamaModel = getattr(model, "net", model)
    ids = torch.as_tensor(token_ids, dtype=torch.int64, device=net.device).reshape(-1)
    if ids.numel() < 2:
        raise ValueError("perplexity needs at least 2 tokens (one to predict from, one to predict)")
    window = window or net.config.max_position_embeddings
    total, count = 0.0, 0
    for start in range(0, ids.numel() - 1, window):
        chunk = ids[start:start + window + 1]
        logits = net.causal_lm_logits(chunk[None, :-1])[0]
        total += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += chunk.numel() - 1
    return float(torch.exp(torch.tensor(total / count)))
