"""ModelConfig: what the executor needs from a Hugging Face `config.json`.

Llama, Qwen2, Qwen3 and Mistral share one architecture (RMSNorm, RoPE, GQA attention,
SwiGLU MLP); they differ only in a few switches, which this file turns into fields:
- Qwen2: bias on the q/k/v projections (always), optional sliding-window layers;
- Llama: optional `attention_bias` (q/k/v/o) and `mlp_bias`, Llama-3 RoPE scaling;
- Mistral: a sliding attention window on every layer;
- Qwen3: an RMSNorm over each head's q and k before RoPE (`qk_norm`), an explicit
  head_dim, no q/k/v bias unless `attention_bias` (then on o_proj too).

Both spellings of RoPE settings are read: transformers 4.x writes `rope_theta` and
`rope_scaling` at the top level, 5.x writes them together in `rope_parameters`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. "linear": every frequency / factor. "llama3": long
    wavelengths (> original_max_position_embeddings / low_freq_factor) / factor, short ones
    (< ... / high_freq_factor) untouched, a smooth blend in between."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The shapes and switches of a Llama-family decoder (field names follow HF's config)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: always; Llama: attention_bias
    o_bias: bool = False  # Llama's attention_bias also puts a bias on o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm (weight of head_dim) on each q and k head
    layer_windows: tuple[int | None, ...] = ()  # sliding window per layer (None: full causal)
    torch_dtype: torch.dtype = torch.float32
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads "
                             f"({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.num_hidden_layers)
        if len(self.layer_windows) != self.num_hidden_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for "
                             f"{self.num_hidden_layers} layers")

    # Sizes of the merged projections: q, k, v stacked on the output dimension.
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Build from a parsed config.json. ValueError for an unknown model_type or RoPE type."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}: this executor supports "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family decoders)")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}: only 'silu' (SwiGLU)")
        heads = d["num_attention_heads"]
        layers = d["num_hidden_layers"]
        theta, scaling = _rope(d)
        attention_bias = bool(d.get("attention_bias", False))
        eos = d.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type in ("llama", "qwen3") and attention_bias,
            qk_norm=model_type == "qwen3",
            mlp_bias=model_type == "llama" and bool(d.get("mlp_bias", False)),
            layer_windows=_layer_windows(d, model_type, layers),
            torch_dtype=_dtype(d.get("dtype") or d.get("torch_dtype") or "float32"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` from a checkpoint directory (or the file itself)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no config.json in {path}: a Hugging "
                                    "Face checkpoint directory "
                                    "holds config.json, model.safetensors and tokenizer.json")
        return cls.from_dict(json.loads(file.read_text()))

    def rope_inv_freq(self) -> torch.Tensor:
        """(head_dim // 2,) fp32 inverse frequencies theta^(-2i/D), scaled as rope_scaling says
        (arithmetic in the order HF uses, so the tables agree to the last bit)."""
        d = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        s = self.rope_scaling
        if s is None or s.rope_type == "default":
            return inv_freq
        if s.rope_type == "linear":
            return inv_freq / s.factor
        # llama3: keep high frequencies (short wavelengths: local word order), stretch the low
        # ones by `factor` (long range), blend linearly in wavelength between the two cutoffs.
        old = s.original_max_position_embeddings
        low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        stretched = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * stretched / s.factor + smooth * stretched
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, blended, stretched)


def _rope(d: dict) -> tuple[float, RopeScaling | None]:
    params = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    merged = {**legacy, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE scaling {rope_type!r}: supported are "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported (RoPE on the whole head)")
    if rope_type == "default":
        return theta, None
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings")
                                              or d.get("max_position_embeddings", 8192)),
    )


def _layer_windows(d: dict, model_type: str, layers: int) -> tuple[int | None, ...]:
    window = d.get("sliding_window")
    if model_type == "llama" or window is None:
        return (None,) * layers
    if model_type == "mistral":
        return (int(window),) * layers
    # qwen2: sliding only when use_sliding_window, on the layers layer_types marks (or, in
    # configs without layer_types, from max_window_layers on).
    if not d.get("use_sliding_window", False):
        return (None,) * layers
    types = d.get("layer_types") or [
        "sliding_attention" if i >= d.get("max_window_layers", layers) else "full_attention"
        for i in range(layers)
    ]
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    name = name.removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}: expected one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def resolve_dtype(dtype: str | torch.dtype | None, default: torch.dtype) -> torch.dtype:
    """A dtype from "float32"/"fp32"/"bf16"/torch.dtype/None (-> default)."""
    if dtype is None:
        return default
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    return _dtype(aliases.get(dtype, dtype) if isinstance(dtype, str) else dtype)
