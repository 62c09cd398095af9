"""Load Hugging Face safetensors checkpoints into LlamaModel, merging projections on the way.

HF stores q_proj, k_proj, v_proj and gate_proj, up_proj as separate matrices; we stack them
(torch.cat on the output dimension) into attn.qkv and mlp.gate_up, so a layer does 2 matmuls
where HF does 5 for the same FLOPs. Every tensor is checked: a missing or unexpected name,
or a shape that disagrees with config.json, is a ValueError that names it.

    HF name (per layer i)                              ours
    model.embed_tokens.weight                          embed.weight
    model.layers.i.input_layernorm.weight              layers.i.attn_norm.weight
    model.layers.i.self_attn.{q,k,v}_proj.{weight,bias} layers.i.attn.qkv.{weight,bias}  (merged)
    model.layers.i.self_attn.o_proj.{weight,bias}      layers.i.attn.o_proj.{weight,bias}
    model.layers.i.self_attn.{q,k}_norm.weight (Qwen3) layers.i.attn.{q,k}_norm.weight
    model.layers.i.post_attention_layernorm.weight     layers.i.mlp_norm.weight
    model.layers.i.mlp.{gate,up}_proj.{weight,bias}    layers.i.mlp.gate_up.{weight,bias}  (merged)
    model.layers.i.mlp.down_proj.{weight,bias}         layers.i.mlp.down.{weight,bias}
    model.norm.weight                                  norm.weight
    lm_head.weight (absent when tied)                  lm_head.weight
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .meta_init import meta_device
from .model import LlamaModel

_SINGLE, _INDEX = "model.safetensors", "model.safetensors.index.json"
_MERGED = {"attn.qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
           "mlp.gate_up": ("mlp", ("gate_proj", "up_proj"))}
_RENAMED = {"attn_norm": "input_layernorm", "attn.o_proj": "self_attn.o_proj",
            "mlp_norm": "post_attention_layernorm", "mlp.down": "mlp.down_proj",
            "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}  # Qwen3
# Outside the layers, only two names differ (lm_head.weight is the same in both).
_OUTER = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory: model.safetensors, or the shards listed by
    model.safetensors.index.json. FileNotFoundError naming what is missing."""
    path = Path(path)
    if (path / _SINGLE).is_file():
        return load_file(path / _SINGLE)
    if not (path / _INDEX).is_file():
        raise FileNotFoundError(f"no weights in {path}: expected {_SINGLE} or {_INDEX}")
    weight_map: dict[str, str] = json.loads((path / _INDEX).read_text())["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not (path / shard).is_file():
            raise FileNotFoundError(f"shard {shard} listed in {_INDEX} is missing from {path}")
        tensors.update(load_file(path / shard))
    missing = set(weight_map) - set(tensors)
    if missing:
        raise ValueError(f"{len(missing)} tensors listed in {_INDEX} are not in their shards, e.g. "
                         f"{sorted(missing)[:3]}")
    return tensors


def _names(model: LlamaModel) -> dict[str, torch.Size]:
    """Our parameter names and shapes (the tied lm_head is the embedding: not loaded twice)."""
    names = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
    if model.config.tie_word_embeddings:
        names.pop("lm_head.weight")
    return names


def hf_to_ours(hf: dict[str, torch.Tensor], model: LlamaModel) -> dict[str, torch.Tensor]:
    """Rename and merge an HF state dict into ours, checking names and shapes against `model`."""
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}  # old checkpoints
    if model.config.tie_word_embeddings:
        hf.pop("lm_head.weight", None)  # some tied checkpoints store a copy anyway
    used: set[str] = set()
    ours: dict[str, torch.Tensor] = {}
    missing: list[str] = []

    def take(name: str) -> torch.Tensor | None:
        if name not in hf:
            missing.append(name)
            return None
        used.add(name)
        return hf[name]

    for name in _names(model):
        parts = name.split(".")
        if parts[0] != "layers":
            tensor = take(_OUTER.get(name, name))
        else:
            i, local, kind = parts[1], ".".join(parts[2:-1]), parts[-1]
            if local in _MERGED:
                block, projections = _MERGED[local]
                pieces = [take(f"model.layers.{i}.{block}.{p}.{kind}") for p in projections]
                tensor = None if any(p is None for p in pieces) else torch.cat(pieces, dim=0)
            else:
                tensor = take(f"model.layers.{i}.{_RENAMED[local]}.{kind}")
        if tensor is not None:
            ours[name] = tensor
    unexpected = sorted(set(hf) - used)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match config.json ({model.config.model_type}): "
                         f"missing {len(missing)} tensors {missing[:4]}, unexpected "
                         f"{len(unexpected)} {unexpected[:4]}")
    shapes = _names(model)
    for name, tensor in ours.items():
        if tensor.shape != shapes[name]:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} in the checkpoint, "
                             f"{tuple(shapes[name])} expected from config.json")
    return ours


def ours_to_hf(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The inverse mapping (merged matrices split back): an HF-named state dict."""
    c = model.config
    splits = {"attn.qkv": [c.q_size, c.kv_size, c.kv_size],
              "mlp.gate_up": [c.intermediate_size] * 2}
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():  # the tied lm_head appears once, as embed
        parts = name.split(".")
        if parts[0] != "layers":
            out[_OUTER.get(name, name)] = p
            continue
        i, local, kind = parts[1], ".".join(parts[2:-1]), parts[-1]
        if local in _MERGED:
            block, projections = _MERGED[local]
            for proj, piece in zip(projections, p.split(splits[local], dim=0), strict=True):
                out[f"model.layers.{i}.{block}.{proj}.{kind}"] = piece
        else:
            out[f"model.layers.{i}.{_RENAMED[local]}.{kind}"] = p
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}


def save_weights(model: LlamaModel, path: str | Path) -> Path:
    """Write model.safetensors with HF names (loads with transformers and with load_model)."""
    file = Path(path) / _SINGLE
    file.parent.mkdir(parents=True, exist_ok=True)
    save_file(ours_to_hf(model), file, metadata={"format": "pt"})
    return file


def load_model(
    path: str | Path,
    *,
    backend: str = "torch",
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    config: ModelConfig | None = None,
) -> LlamaModel:
    """config.json + safetensors in `path` -> LlamaModel on `device` in `dtype` (default:
    the checkpoint's dtype). The module is built on the meta device (no memory, no random
    init) and the loaded tensors are assigned into it."""
    config = config or ModelConfig.from_pretrained(path)
    dtype = dtype or config.torch_dtype
    device = torch.device(device or "cpu")
    with meta_device():
        model = LlamaModel(config, backend=backend)
    state = {
        k: v.to(device=device, dtype=dtype)
        for k, v in hf_to_ours(read_safetensors(path), model).items()
    }
    model.load_state_dict(state, strict=False, assign=True)  # names checked above
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.init_rope(device)
    return model.eval()


def random_model(
    config: ModelConfig,
    *,
    backend: str = "torch",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    seed: int = 0,
    std: float = 0.02,
) -> LlamaModel:
    """A model of `config`'s shape with random N(0, std) weights (norm weights 1): for
    benchmarks of real shapes without downloading anything (say so in their output)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with meta_device():
        model = LlamaModel(config, backend=backend)
    state = {}
    for name, shape in _names(model).items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            state[name] = (torch.randn(shape, generator=gen) * std).to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.init_rope(device)
    return model.eval()
