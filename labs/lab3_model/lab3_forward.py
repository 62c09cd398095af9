"""The course model's forward pass written out in plain PyTorch, built from lab 3's pieces.

`forward(ex, net, token_ids, start, cache)` runs the whole Llama decoder with `ex.rms_norm`,
`ex.apply_rope` and `ex.gqa_attention` (your exercises.py, or the reference) and the course
model's trained weights, which it reads from layer3_model's loaded network. Everything else
— the embedding lookup, the merged projections, SiLU-and-multiply, the residual adds — is
written here, one line per step of the graph in layer3_model/README.md:

    x = embed[token_ids]                                  (T, H)
    per layer:
        h = rms_norm(x)                                   (T, H)
        q | k | v = h @ W_qkv^T                           (T, (Hq + 2 Hkv) D)  merged
        q, k = rope(q), rope(k)                           (T, Hq, D), (T, Hkv, D)
        o = gqa_attention(q, k, v, cache[layer], start)   (T, Hq, D)
        x = x + o @ W_o^T                                 (T, H)
        gate | up = rms_norm(x) @ W_gate_up^T             (T, 2F)              merged
        x = x + (silu(gate) * up) @ W_down^T              (T, H)
    logits = rms_norm(x) @ W_lm_head^T                    (T, V)

The grader (tests/labs/test_lab3.py) compares these logits with `layer3_model`'s own
(`layer3_forward`), and `generate` samples text with your `top_p_sample`.
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

import layer3_model as l3

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def load_course_model(size: str = "target") -> l3.Model:
    """layer3_model's course model (network + tokenizer), fp32 on the CPU."""
    return l3.load(l3.course_model_dir(size), dtype="float32", device="cpu")


def new_cache(config: l3.ModelConfig, max_len: int) -> KVCaches:
    """One (k_cache, v_cache) pair per layer, each (max_len, Hkv, D) fp32 zeros."""
    shape = (max_len, config.num_key_value_heads, config.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]


@torch.no_grad()
def forward(ex: ModuleType, net: l3.LlamaModel, token_ids: torch.Tensor, start: int,
            cache: KVCaches) -> torch.Tensor:
    """Logits (T, V) fp32 for T new tokens at positions start .. start+T-1 of one sequence,
    whose first `start` tokens are already in `cache` (their k, v are added to it)."""
    c = net.config
    if c.rope_scaling is not None or c.qkv_bias or c.o_bias or c.mlp_bias or any(c.layer_windows):
        raise ValueError("this forward is the plain Llama of the course model: no RoPE scaling, "
                         "biases or sliding windows")
    T, Hq, Hkv, D = token_ids.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
    positions = torch.arange(start, start + T)
    x = net.embed.weight[token_ids]  # (T, H): a lookup, no FLOPs
    for i, layer in enumerate(net.layers):
        h = ex.rms_norm(x, layer.attn_norm.weight, c.rms_norm_eps)
        qkv = h @ layer.attn.qkv.weight.T  # one matmul for q, k and v
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q = ex.apply_rope(q.reshape(T, Hq, D), positions, c.rope_theta)
        k = ex.apply_rope(k.reshape(T, Hkv, D), positions, c.rope_theta)
        o = ex.gqa_attention(q, k, v.reshape(T, Hkv, D), *cache[i], start)
        x = x + o.reshape(T, Hq * D) @ layer.attn.o_proj.weight.T
        h = ex.rms_norm(x, layer.mlp_norm.weight, c.rms_norm_eps)
        gate, up = (h @ layer.mlp.gate_up.weight.T).chunk(2, dim=-1)  # one matmul for both
        x = x + (F.silu(gate) * up) @ layer.mlp.down.weight.T
    return (ex.rms_norm(x, net.norm.weight, c.rms_norm_eps) @ net.lm_head.weight.T).float()


@torch.no_grad()
def layer3_forward(net: l3.LlamaModel, token_ids: torch.Tensor, start: int,
                   cache: l3.ContiguousKVCache) -> torch.Tensor:
    """The same step through layer3_model's own network and KV cache: logits (T, V)."""
    ctx = cache.context([token_ids.shape[0]], [start])
    return net(token_ids, ctx, cache)


def generate(ex: ModuleType, model: l3.Model, prompt_ids: list[int], max_new_tokens: int = 48, *,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             stop: str | None = "\n\n") -> tuple[list[int], str]:
    """Prefill the prompt, then decode one token at a time through the KV cache, each drawn
    with ex.top_p_sample. Stops at EOS, at `stop` in the text, or after max_new_tokens.
    Returns (new token ids, their text)."""
    net, tok = model.net, model.tokenizer
    cache = new_cache(model.config, len(prompt_ids) + max_new_tokens)
    gen = torch.Generator().manual_seed(seed)
    logits = forward(ex, net, torch.tensor(prompt_ids), 0, cache)[-1:]
    out: list[int] = []
    for step in range(max_new_tokens):
        token = int(ex.top_p_sample(logits, top_p, temperature, gen)[0])
        if token in model.eos_token_ids:
            break
        out.append(token)
        text = tok.decode(out)
        if stop and stop in text:
            return out, text[: text.index(stop)]
        if step + 1 < max_new_tokens:
            logits = forward(ex, net, torch.tensor([token]), len(prompt_ids) + step, cache)
    return out, tok.decode(out)
