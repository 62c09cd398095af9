"""The one place layer 5's training code touches layer 3's model (switch here if it changes).

Pipeline, DDP and ZeRO all cut layer 3's `LlamaModel` into *units* run one after another:

    embed:   ids (B, T)                    -> stream
    layer i: stream                        -> stream        (i = 0 .. L-1)
    head:    stream, targets (B, T)        -> loss (a 0-d tensor)

With layer 3's training path (`model.embed_tokens`, `model.causal_layers`, `model.head`) the
stream is x (B, T, H). With only the serving path it is the pair (x, residual) stacked as
(2, B*T, H): that path fuses the residual add into the next RMSNorm, so a block hands on
both halves; the embedding starts it as (x, 0), which a norm treats exactly as no residual.
`stream_shape` says which; nothing outside this file depends on it.

The loss of a piece of a batch is its summed token cross-entropy divided by `total_tokens`
(the whole batch's count), so the pieces' losses — and their gradients — add up to the
full batch's mean loss: micro-batches (pipeline) and batch shards (DDP) sum exactly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import layer4_algorithms as engine

executor = engine.executor


def tiny_config(layers: int = 4, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                vocab: int = 96, ffn: int = 136, tie: bool = False) -> executor.ModelConfig:
    """A small Llama shape for tests and benchmarks (fp32, head_dim = hidden / heads)."""
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
    return executor.ModelConfig(
        model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=256, tie_word_embeddings=tie)


def build_model(config: executor.ModelConfig, seed: int = 0) -> nn.Module:
    """Layer 3's LlamaModel with random weights (same seed -> same weights on every rank)."""
    return executor.random_model(config, seed=seed, std=0.1).train()


def causal_context(batch: int, seq_len: int, device: torch.device | str = "cpu"):
    """An AttentionContext for `batch` whole sequences of `seq_len` tokens, nothing cached."""
    return executor.AttentionContext.build([seq_len] * batch, [0] * batch,
                                           torch.zeros(batch * seq_len, dtype=torch.int64),
                                           device=device)


def num_units(model: nn.Module) -> int:
    """embed + decoder layers + head."""
    return len(model.layers) + 2


def unit_modules(model: nn.Module, unit: int) -> list[nn.Module]:
    """The modules whose parameters unit `unit` uses (0 = embed, 1..L = layers, L+1 = head)."""
    last = num_units(model) - 1
    if not 0 <= unit <= last:
        raise ValueError(f"unit must be in 0..{last}, got {unit}")
    if unit == 0:
        return [model.embed]
    if unit == last:
        return [model.norm, model.lm_head]
    return [model.layers[unit - 1]]


def unit_params(model: nn.Module, unit: int) -> list[nn.Parameter]:
    """Unit `unit`'s parameters, each once (a tied LM head is the embedding's matrix)."""
    seen, out = set(), []
    for module in unit_modules(model, unit):
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _training_path(model: nn.Module) -> bool:
    return hasattr(model, "causal_layers")


def stream_shape(model: nn.Module, batch: int, seq_len: int) -> tuple[int, ...]:
    """The shape of the tensor passed between units for a (batch, seq_len) piece."""
    H = model.config.hidden_size
    return (batch, seq_len, H) if _training_path(model) else (2, batch * seq_len, H)


def embed(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """ids (B, T) int64 -> the stream."""
    if _training_path(model):
        return model.embed_tokens(ids)
    x = model.embed(ids.reshape(-1))
    return torch.stack([x, torch.zeros_like(x)])


def run_layer(model: nn.Module, layer: int, stream: torch.Tensor,
              batch_shape: tuple[int, int]) -> torch.Tensor:
    """Decoder layer `layer` over the stream of a (B, T) piece -> the next stream."""
    if _training_path(model):
        return model.causal_layers(stream, slice(layer, layer + 1))
    ctx = causal_context(*batch_shape, stream.device)
    block = model.layers[layer]
    x, residual = block(stream[0], stream[1], ctx, None, model.ops, model.cos, model.sin)
    return torch.stack([x, residual])


def head_logits(model: nn.Module, stream: torch.Tensor) -> torch.Tensor:
    """stream of a (B, T) piece -> fp32 logits (B*T, V) (training path: (B, T, V))."""
    if _training_path(model):
        return model.head(stream)
    h, _ = model.norm(stream[0], model.ops, stream[1])
    return model.lm_head(h).float()


def head_loss(model: nn.Module, stream: torch.Tensor, targets: torch.Tensor,
              total_tokens: int) -> torch.Tensor:
    """stream, targets (B, T) -> sum of token cross-entropy / total_tokens."""
    logits = head_logits(model, stream)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction="sum") / total_tokens


def run_unit(model: nn.Module, unit: int, inp: torch.Tensor, targets: torch.Tensor,
             total_tokens: int) -> torch.Tensor:
    """Run unit `unit` of a (B, T) piece: inp is ids for the embed, a stream otherwise;
    targets (B, T) (the head reads them, the others their shape)."""
    last = num_units(model) - 1
    if unit == 0:
        return embed(model, inp)
    if unit == last:
        return head_loss(model, inp, targets, total_tokens)
    return run_layer(model, unit - 1, inp, tuple(targets.shape))


def full_loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor,
              total_tokens: int | None = None) -> torch.Tensor:
    """The single-process reference: ids, targets (B, T) -> mean token cross-entropy
    (or the sum / total_tokens for a piece of a larger batch)."""
    out = ids
    for unit in range(num_units(model)):
        out = run_unit(model, unit, out, targets, total_tokens or ids.numel())
    return out


def model_loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean token cross-entropy through the model's own whole-sequence forward (to check
    that the units above add up to the model)."""
    logits = model(ids) if _training_path(model) else model.causal_lm_logits(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def random_batch(config: executor.ModelConfig, batch: int, seq_len: int,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (ids, targets), each (batch, seq_len) int64 (targets = ids shifted by one)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
