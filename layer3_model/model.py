"""A Llama-family decoder in plain PyTorch (Llama, Qwen2, Qwen3, Mistral share it): the one
model this project serves and trains. (Qwen3 adds a per-head RMSNorm on q and k before RoPE.)

One serving step over T new tokens of B sequences (shapes for hidden H, Hq query heads,
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

Training (and layer 5's parallel schedules) calls the same modules over a (B, T) batch with
no cache: `model(input_ids (B, T))` -> logits (B, T, V), causal attention through
`scaled_dot_product_attention`, autograd, residual dropout in train mode; `model.loss(ids,
targets)` is next-token cross-entropy. The pieces are public so a pipeline stage can run a
slice of them: `embed`, `causal_layers(x, slice)`, `head(x)`. See training.py.

Merging (done once, when weights load): q, k and v read the same input, so their weight
matrices are stacked into one and one matmul reads the activations once and launches once;
gate and up likewise. Fusion (done by the kernels): RMSNorm + residual add, SiLU * up and
RoPE on q and k each run as one pass over memory instead of several.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .attention_context import AttentionContext, KVCache
from .backends import Ops, cudnn_attention_refusal, make_ops, masked_attention
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
        self.layer = layer
        self.window = c.layer_windows[layer]
        self.n_heads = c.num_attention_heads
        self.n_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.qkv = nn.Linear(c.hidden_size, c.q_size + 2 * c.kv_size, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.q_size, c.hidden_size, bias=c.o_bias)
        # Qwen3: each head's q and k RMS-normalised (one weight of head_dim shared by the
        # heads) before RoPE, which keeps attention logits bounded without a qkv bias.
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None

    def _qkv(self, x: torch.Tensor,
             ops: Ops) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (..., H) -> q (..., Hq, D), k and v (..., Hkv, D). Views, not copies: each
        head's D values are contiguous inside the qkv row (q and k are new tensors when
        normalised: Qwen3)."""
        D = self.head_dim
        sizes = [self.n_heads * D, self.n_kv_heads * D, self.n_kv_heads * D]
        q, k, v = self.qkv(x).split(sizes, dim=-1)
        lead = x.shape[:-1]
        q, k = q.view(*lead, self.n_heads, D), k.view(*lead, self.n_kv_heads, D)
        if self.q_norm is not None:  # over the last dim, D: per head
            q, k = self.q_norm(q.contiguous(), ops), self.k_norm(k.contiguous(), ops)
        return q, k, v.view(*lead, self.n_kv_heads, D)

    def forward(self, x: torch.Tensor, ctx: AttentionContext, cache: KVCache | None, ops: Ops,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Serving: x (T, H) flat new tokens -> (T, H)."""
        q, k, v = self._qkv(x, ops)
        fused = (cache is not None and ops.rope_write is not None
                 and ops.rope_write(q, k, v, cos, sin, ctx, cache, self.layer))
        if not fused:  # one launch saved per kernel fused above (host time)
            q, k = ops.rope(q, k, cos, sin, ctx.positions)
            if cache is not None:
                cache.write(self.layer, k, v, ctx)
        o = ops.attention(q, k, v, ctx, cache, self.layer, self.scale, self.window)
        return self.o_proj(o.reshape(x.shape[0], self.n_heads * self.head_dim))

    def decode_fused(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                     ctx: AttentionContext, cache: KVCache, dk, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode step through the fused kernels (dk: Ops.decode): the norm in the qkv GEMV,
        RoPE with the cache write, split attention, o_proj. Returns (out, new residual)."""
        T, D = x.shape[0], self.head_dim
        heads = (self.n_heads, self.n_kv_heads, D)
        if dk.fuse_rope:  # RoPE and the cache write in the qkv GEMV's epilogue
            qkv, residual = dk.norm_qkv_rope_write(x, residual, norm, self.qkv, heads, cos, sin,
                                                   ctx, cache, self.layer)
            q = qkv[:, :self.n_heads * D].view(T, self.n_heads, D)
        else:
            qkv, residual = dk.norm_linear(x, residual, norm, self.qkv)
            q, k, v = qkv.split([self.n_heads * D, self.n_kv_heads * D, self.n_kv_heads * D],
                                dim=-1)
            q, k, v = (t.view(T, -1, D) for t in (q, k, v))
            dk.rope_write(q, k, v, cos, sin, ctx, cache, self.layer)
        o = dk.attention(q, ctx, cache, self.layer, self.scale, self.window)
        return dk.linear(o.reshape(T, self.n_heads * D), self.o_proj), residual

    def causal(self, x: torch.Tensor, ops: Ops, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """Training: x (B, T, H), every sequence from position 0, no cache -> (B, T, H)."""
        B, T, _ = x.shape
        q, k, v = self._qkv(x, ops)
        q, k = ops.rope(q, k, cos, sin, positions)  # (T, 1, D) tables broadcast over B
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, T, D)
        if self.window is None or T <= self.window:
            # SDPA picks a fused kernel (flash / memory-efficient on a GPU) with a backward.
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True,
                                               scale=self.scale, enable_gqa=True)
            o = o.transpose(1, 2)
        else:  # a sliding window needs its own mask: the serving path's padded attention
            o = masked_attention(q, k, v, x.new_zeros(B, dtype=torch.int64), self.scale,
                                 self.window)
        return self.o_proj(o.reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, ffn, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=bias)
        self.down = nn.Linear(ffn, hidden, bias=bias)

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

    def decode_fused(self, x, residual, ctx, cache, dk, cos, sin):
        """forward's decode step through the fused kernels (dk: Ops.decode): five launches."""
        x, residual = self.attn.decode_fused(x, residual, self.attn_norm, ctx, cache, dk, cos, sin)
        gu, residual = dk.norm_linear(x, residual, self.mlp_norm, self.mlp.gate_up)
        return dk.silu_linear(gu, self.mlp.down), residual

    def causal(self, x: torch.Tensor, ops: Ops, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor, dropout: float) -> torch.Tensor:
        """Training: x (B, T, H) -> (B, T, H), residual adds written out (autograd sees
        them). Residual dropout regularises training on a small corpus; it is the identity
        in eval mode, so the served model computes what the trained one did."""
        attn = self.attn.causal(self.attn_norm(x, ops), ops, cos, sin, positions)
        x = x + F.dropout(attn, dropout, self.training)
        return x + F.dropout(self.mlp(self.mlp_norm(x, ops), ops), dropout, self.training)


class LlamaModel(nn.Module):
    """The decoder and its LM head. Weights use our merged names (see weights.py):
    embed, layers.i.{attn_norm, attn.qkv, attn.o_proj, mlp_norm, mlp.gate_up, mlp.down},
    norm, lm_head. dropout: residual dropout of the training path (train mode only)."""

    def __init__(self, config: ModelConfig, backend: str = "torch", *,
                 dropout: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.config = config
        self.dropout = dropout
        self.ops = make_ops(backend)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        layers = range(config.num_hidden_layers)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight  # one matrix, two uses
        self.init_weights()
        self.init_rope()

    @property
    def backend(self) -> str:
        return self.ops.name

    def set_backend(self, backend: str, *, impl: str = "auto",
                    prefill_attention: str = "flash") -> None:
        """Switch kernels ("torch", "triton", "compile"); weights stay as they are.
        prefill_attention: a lone prompt's attention, "flash" (layer 1's kernel) or "cudnn"
        (the triton backend only, on a CUDA GPU in fp16/bf16: checked here, against the
        weights as they are now; see backends.PREFILL_ATTENTION)."""
        if prefill_attention == "cudnn":
            refusal = cudnn_attention_refusal(self.device, self.dtype)
            if refusal:
                raise ValueError(refusal)
        self.ops = make_ops(backend, impl=impl, prefill_attention=prefill_attention)

    @property
    def prefill_attention(self) -> str:
        """A lone prompt's attention: "flash" or "cudnn" (set_backend)."""
        return self.ops.prefill_attention

    def init_rope(self, device: torch.device | str | None = None) -> None:
        """cos/sin tables (max_position_embeddings, D/2), fp32, for every position up front.
        On the meta device only their shapes (a module built there gets its tables from
        init_rope(device) once its weights are assigned)."""
        if torch.empty(0, device=device).is_meta:  # (meta math would run PyTorch's Python refs)
            shape = (self.config.max_position_embeddings, self.config.head_dim // 2)
            self.register_buffer("cos", torch.empty(shape, device=device), persistent=False)
            self.register_buffer("sin", torch.empty(shape, device=device), persistent=False)
            return
        inv_freq = self.config.rope_inv_freq().to(device)
        positions = torch.arange(self.config.max_position_embeddings, device=device,
                                 dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Training from scratch: matrices N(0, std), norms 1, biases 0; the projections
        that write into the residual stream (o_proj, down) scaled by 1/sqrt(2 * layers) so
        the stream's variance does not grow with depth at initialisation (GPT-2's recipe).
        Free on the meta device, where load_model builds the module before loading."""
        deep = std / math.sqrt(2 * self.config.num_hidden_layers)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, deep if name.endswith(("o_proj.weight", "down.weight")) else std)
            else:
                p.fill_(1.0 if name.endswith("norm.weight") else 0.0)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def num_parameters(self) -> int:
        """Distinct parameters (a tied lm_head counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids: torch.Tensor, ctx: AttentionContext | None = None,
                cache: KVCache | None = None, *, last_only: bool = False,
                logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """Two calls, one network; both return fp32 logits.

        model(input_ids (B, T)): training and scoring. Each of the B sequences starts at
            position 0 and sees only itself and earlier tokens; no cache; -> (B, T, V).
        model(input_ids (T,), ctx, cache): a serving step over T flat new tokens that
            `ctx` describes -> (T, V), or (B, V) for each sequence's last token with
            last_only. cache None: a prefill with nothing cached (scoring text).
            logits_out: an fp32 tensor of the logits' shape to write them into and return
            (a CUDA graph's static output): the LM head's output converted in one pass,
            where .float() and a copy into it would write and read the fp32 logits twice."""
        if ctx is None:
            if cache is not None or last_only or logits_out is not None:
                raise ValueError("cache, last_only and logits_out need an AttentionContext "
                                 "(serving step)")
            return self.head(self.causal_layers(self.embed_tokens(input_ids)))
        if cache is None and not ctx.is_prefill:
            raise ValueError("a step that continues cached sequences needs the cache")
        x, residual = self.embed(input_ids), None
        dk = self.ops.decode
        if dk is not None and dk.applies(self, x, ctx, cache):
            # Small decode step: fused kernels (backends.DecodeKernels); every row is a
            # sequence's last token, so last_only changes nothing.
            for layer in self.layers:
                x, residual = layer.decode_fused(x, residual, ctx, cache, dk, self.cos, self.sin)
            logits, _ = dk.norm_linear(x, residual, self.norm, self.lm_head,
                                       out_dtype=torch.float32)  # = .float(), no own kernel
            return logits if logits_out is None else _into(logits_out, logits)
        for layer in self.layers:
            x, residual = layer(x, residual, ctx, cache, self.ops, self.cos, self.sin)
        if last_only:  # only the logits that pick the next token: skip (T - B) rows of lm_head
            last = ctx.query_start_loc[1:] - 1
            x, residual = x[last], residual[last]
        x, _ = self.norm(x, self.ops, residual)
        logits = self.lm_head(x)
        return logits.float() if logits_out is None else _into(logits_out, logits)

    # ---- the training path, in pieces a pipeline stage can run a slice of -----------------
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, T) int -> x (B, T, H). ValueError for another shape or a T longer
        than the RoPE tables."""
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"training input_ids must be (batch, seq) integers, got "
                             f"{tuple(input_ids.shape)} {input_ids.dtype}")
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {input_ids.shape[1]} tokens exceeds "
                             f"max_position_embeddings {self.config.max_position_embeddings}")
        return self.embed(input_ids)

    def causal_layers(self, x: torch.Tensor, layers: slice = slice(None)) -> torch.Tensor:
        """x (B, T, H) through self.layers[layers] (all by default) -> (B, T, H)."""
        if self.backend == "triton" and torch.is_grad_enabled():
            raise ValueError("backend 'triton' has no backward (its RoPE works in place): "
                             "train with backend 'torch' or 'compile'")
        positions = torch.arange(x.shape[1], device=x.device)
        for layer in self.layers[layers]:
            x = layer.causal(x, self.ops, self.cos, self.sin, positions, self.dropout)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, H) -> final norm -> lm_head -> fp32 logits (B, T, V)."""
        return self.lm_head(self.norm(x, self.ops)).float()

    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor,
             ignore_index: int = -100) -> torch.Tensor:
        """Mean next-token cross-entropy of model(input_ids) against targets (B, T)."""
        return causal_lm_loss(self(input_ids), targets, ignore_index)

    def causal_lm_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, L) -> logits (B, L, V) through the serving path (this backend's
        kernels, flat tokens, padded attention): the arithmetic generation uses, for
        scoring text and checking cached steps against. Training uses model(input_ids)."""
        B, L = input_ids.shape
        ctx = AttentionContext.build([L] * B, [0] * B, torch.zeros(B * L, dtype=torch.int64),
                                     device=input_ids.device)
        return self.forward(input_ids.reshape(-1), ctx, None).view(B, L, -1)


def _into(out: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """logits (any float dtype) into the fp32 tensor out of the same shape; returns out."""
    if out.dtype != torch.float32 or out.shape != logits.shape:
        raise ValueError(f"logits_out must be float32 of the logits' shape "
                         f"{tuple(logits.shape)}, got {out.dtype} {tuple(out.shape)}")
    return out.copy_(logits)


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor,
                   ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of logits (B, T, V) against targets (B, T) (the next token at
    each position; ignore_index marks positions that do not count), in fp32."""
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"logits (B, T, V) and targets (B, T) expected, got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                           ignore_index=ignore_index)
