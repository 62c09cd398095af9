"""A Llama-family decoder in plain PyTorch (Llama, Qwen2, Mistral share it).

One forward step over T new tokens of B sequences (shapes for hidden H, Hq query heads,
Hkv kv heads, head dim D, FFN width F, vocab V):

    input_ids (T,) -> embed -> x (T, H)
    N x  h = x + attention(rms_norm(x))                      (residual add fused into the norm)
           qkv = h_norm @ W_qkv^T          (T, (Hq + 2 Hkv) D)   one merged matmul, not three
           q, k = rope(q, k, positions)    (T, Hq, D), (T, Hkv, D)
           cache.write(k, v); o = attention(q, cache.read())    (T, Hq, D)
           out = o @ W_o^T                 (T, H)
         x = h + mlp(rms_norm(h))
           gu = h_norm @ W_gate_up^T       (T, 2F)   merged gate and up projections
           out = (silu(gate) * up) @ W_down^T        (T, H)
    rms_norm -> lm_head -> logits (T, V)   (or only each sequence's last token: (B, V))

Merging (done once, when weights load): q, k and v read the same input, so their weight
matrices are stacked into one and one matmul reads the activations once and launches once;
gate and up likewise. Fusion (done by the kernels): RMSNorm + residual add, SiLU * up and
RoPE on q and k each run as one pass over memory instead of several.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .attention_context import AttentionContext, KVCache
from .backends import Ops, make_ops
from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: Ops, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.layer, self.window = layer, c.layer_windows[layer]
        self.n_heads, self.n_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.qkv = nn.Linear(c.hidden_size, c.q_size + 2 * c.kv_size, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.q_size, c.hidden_size, bias=c.o_bias)

    def forward(self, x: torch.Tensor, ctx: AttentionContext, cache: KVCache | None, ops: Ops,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        q, k, v = self.qkv(x).split([self.n_heads * D, self.n_kv_heads * D, self.n_kv_heads * D], dim=-1)
        # Views, not copies: each head's D values are contiguous inside the qkv row.
        q, k, v = q.view(T, self.n_heads, D), k.view(T, self.n_kv_heads, D), v.view(T, self.n_kv_heads, D)
        q, k = ops.rope(q, k, cos, sin, ctx.positions)
        if cache is not None:
            cache.write(self.layer, k, v, ctx)
        o = ops.attention(q, k, v, ctx, cache, self.layer, self.scale, self.window)
        return self.o_proj(o.reshape(T, self.n_heads * D))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        return self.down(ops.silu_and_mul(self.gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, ctx, cache, ops, cos, sin):
        """x: the previous block's output (T, H); residual: the stream before it (None at
        layer 0). Returns the same pair: the add happens inside the next norm (fused)."""
        if residual is None:
            x, residual = self.attn_norm(x, ops), x
        else:
            x, residual = self.attn_norm(x, ops, residual)
        x = self.attn(x, ctx, cache, ops, cos, sin)
        x, residual = self.mlp_norm(x, ops, residual)
        return self.mlp(x, ops), residual


class LlamaModel(nn.Module):
    """The decoder and its LM head. Weights use our merged names (see weights.py):
    embed, layers.i.{attn_norm, attn.qkv, attn.o_proj, mlp_norm, mlp.gate_up, mlp.down}, norm, lm_head."""

    def __init__(self, config: ModelConfig, backend: str = "torch") -> None:
        super().__init__()
        self.config = config
        self.ops = make_ops(backend)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight  # one matrix, two uses
        self.init_rope()

    @property
    def backend(self) -> str:
        return self.ops.name

    def set_backend(self, backend: str, *, impl: str = "auto") -> None:
        """Switch kernels ("torch", "triton", "compile"); weights stay as they are."""
        self.ops = make_ops(backend, impl=impl)

    def init_rope(self, device: torch.device | str | None = None) -> None:
        """cos/sin tables (max_position_embeddings, D/2), fp32, for every position up front."""
        inv_freq = self.config.rope_inv_freq().to(device)
        positions = torch.arange(self.config.max_position_embeddings, device=device, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def forward(self, input_ids: torch.Tensor, ctx: AttentionContext, cache: KVCache | None = None,
                *, last_only: bool = False) -> torch.Tensor:
        """input_ids (T,) flat new tokens -> fp32 logits (T, V), or (B, V) for each sequence's
        last token with last_only. cache None: a prefill with nothing cached (scoring text)."""
        if cache is None and not ctx.is_prefill:
            raise ValueError("a step that continues cached sequences needs the cache")
        x, residual = self.embed(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx, cache, self.ops, self.cos, self.sin)
        if last_only:  # only the logits that pick the next token: skip (T - B) rows of lm_head
            last = ctx.query_start_loc[1:] - 1
            x, residual = x[last], residual[last]
        x, _ = self.norm(x, self.ops, residual)
        return self.lm_head(x).float()

    def causal_lm_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence forward with no cache, for scoring and training: input_ids (B, L) ->
        logits (B, L, V), each position seeing only itself and earlier ones."""
        B, L = input_ids.shape
        ctx = AttentionContext.build([L] * B, [0] * B, torch.zeros(B * L, dtype=torch.int64),
                                     device=input_ids.device)
        return self.forward(input_ids.reshape(-1), ctx, None).view(B, L, -1)
