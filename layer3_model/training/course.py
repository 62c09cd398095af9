"""The course model's shapes, and its Hugging Face export.

The course model *is* the executor's `LlamaModel` (model.py): the network that serves is the
one that trains (`model(ids (B, T))` -> logits, `model.loss(ids, targets)`). This file only
says which shapes the course trains (`SIZES`, as `ModelConfig`s) and writes / reads the
directory that the executor and `transformers.AutoModelForCausalLM` both load: HF tensor
names (`model.layers.0.self_attn.q_proj.weight`...: weights.py splits our merged q/k/v and
gate/up matrices back apart), config.json and generation_config.json.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from ..model import LlamaModel
from ..weights import load_model, ours_to_hf


def course_config(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int,
                  vocab_size: int = 4096, max_position_embeddings: int = 512) -> ModelConfig:
    """A Llama shape with the course's fixed choices: head_dim = hidden / heads, RMSNorm
    eps 1e-5, RoPE theta 10^4, tied embeddings, no biases."""
    if hidden % heads:
        raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    return ModelConfig(model_type="llama", vocab_size=vocab_size, hidden_size=hidden,
                       intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=hidden // heads, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=max_position_embeddings,
                       tie_word_embeddings=True)


# The two course models: target ~11M parameters, draft ~1.2M (same tokenizer, for speculative
# decoding). The draft has only 2 layers: at batch 1 a small model's step costs per-layer
# overhead more than FLOPs, and speculative decoding pays off only when a draft step is a small
# fraction of a target step.
SIZES: dict[str, ModelConfig] = {
    "target": course_config(hidden=384, ffn=1024, layers=6, heads=6, kv_heads=2),
    "draft": course_config(hidden=160, ffn=448, layers=2, heads=5, kv_heads=1),
    # For tests and smoke runs: trains in seconds on a CPU.
    "tiny": course_config(hidden=32, ffn=64, layers=2, heads=4, kv_heads=2),
}


def new_model(size: str, vocab_size: int, seq: int, dropout: float = 0.0) -> LlamaModel:
    """A freshly initialised course model of SIZES[size] for a vocabulary and a context."""
    if size not in SIZES:
        raise ValueError(f"unknown course model size {size!r}: expected one of {', '.join(SIZES)}")
    config = dataclasses.replace(SIZES[size], vocab_size=vocab_size,
                                 max_position_embeddings=seq)
    return LlamaModel(config, dropout=dropout)


def hf_config(config: ModelConfig, bos: int, eos: int, pad: int,
              dtype: torch.dtype) -> dict[str, object]:
    """config.json for `LlamaForCausalLM` (a course shape: no biases, no RoPE scaling)."""
    if config.model_type != "llama" or config.rope_scaling or config.qkv_bias or config.mlp_bias:
        raise ValueError("hf_config writes plain Llama configs (no biases, no RoPE scaling)")
    shape = {name: getattr(config, name) for name in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
        "rms_norm_eps", "rope_theta", "tie_word_embeddings", "head_dim")}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "attention_dropout": 0.0, "rope_scaling": None, "initializer_range": 0.02,
            "pretraining_tp": 1, "use_cache": True,
            "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
            "torch_dtype": str(dtype).removeprefix("torch.")}


def save_hf(model: LlamaModel, out: Path, special_ids: dict[str, int],
            dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json, generation_config.json and model.safetensors with HF names (a tied
    lm_head omitted, as HF does)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(dtype).contiguous() for k, v in ours_to_hf(model).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; the file ships in the repo
    bos, eos, pad = special_ids["bos"], special_ids["eos"], special_ids["pad"]
    cfg = hf_config(model.config, bos, eos, pad, dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "do_sample": True,
           "temperature": 0.8, "top_k": 40, "top_p": 0.95, "max_new_tokens": 256}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


def load_hf(path: Path, dropout: float = 0.0) -> LlamaModel:
    """A trainable LlamaModel (fp32, train mode) from a model directory, e.g. to fine-tune."""
    model = load_model(path, dtype=torch.float32)
    model.dropout = dropout
    return model.train()
