"""Load a `.gguf` file (llama.cpp's format) into the same `LlamaModel` a HF directory gives.

A GGUF file holds metadata (key -> value: shapes, RoPE, the tokenizer) and tensors, each in
its own storage type. We read both with the `gguf` package (llama.cpp's own reader):

- config: `{arch}.embedding_length`, `.block_count`, `.attention.head_count(_kv)`,
  `.attention.key_length` (head_dim, when given), `.rope.freq_base`, `.rope.scaling.*`,
  `.attention.layer_norm_rms_epsilon`, `.context_length`; tied embeddings = no
  `output.weight` tensor. They become a HF-style config dict, so `ModelConfig.from_dict`
  validates them as it does config.json.
- tensors: dequantized with `gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
  Q5_0, Q5_1 and the K-quants Q2_K..Q6_K) to fp32, then cast to the executor's dtype.
- Q/K rows: llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ... of each head; HF
  rotates the two halves (x_i, x_{i + D/2}). Its converter therefore permutes the rows of
  attn_q / attn_k of `llama` models per head, (2, D/2) -> (D/2, 2); we undo that. Qwen2/3
  use the half-split ("NEOX") rotation in llama.cpp too: their rows are not permuted.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize

from .config import ModelConfig

# GGUF architecture -> our model_type. llama.cpp writes Mistral checkpoints as "llama".
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
PERMUTED_ARCHITECTURES = ("llama",)  # attn_q / attn_k rows interleaved by the converter
TENSOR_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Per-layer GGUF tensor names -> HF names (weights.py maps HF names to ours).
_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_OUTER = {"token_embd.weight": "model.embed_tokens.weight",
          "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


class PlainGGUFReader(GGUFReader):
    """gguf's reader over a plain ndarray view of its memory map. The reader slices its data
    once per value while parsing (~250k slices for a 49k-token vocabulary) and dequantizing,
    and every slice of an np.memmap runs memmap's Python-level __array_finalize__: the
    smollm2 file parsed in 4.2 s of CPU, 1.5 s so; dequantized in 2.0 s, 1.4 s. The same
    bytes and mapping (the view holds the memmap as its base), the same values."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:  # GGUFReader.__init__ sets its np.memmap here
        self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value


def open_gguf(path: str | Path) -> GGUFReader:
    """The file's reader. ValueError naming the file for anything that is not a whole GGUF
    file (bad magic, truncated tensor data, a corrupt header)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        return PlainGGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, EOFError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{path}: not a valid GGUF file (truncated or corrupt?): "
                         f"{first}") from None


def field(reader: GGUFReader, key: str, default: object = None) -> object:
    """A metadata value as Python (str, int, float, bool or list), or `default`."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def architecture(reader: GGUFReader, path: str | Path) -> str:
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}: this executor loads "
                         f"{', '.join(ARCHITECTURES)}")
    return str(arch)


def hf_config(reader: GGUFReader, path: str | Path) -> dict:
    """The file's metadata as a HF config.json dict (what ModelConfig.from_dict reads)."""
    arch = architecture(reader, path)

    def need(key: str) -> object:
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path}: metadata key {arch}.{key} is missing")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    names = {t.name for t in reader.tensors}
    tokens = field(reader, "tokenizer.ggml.tokens")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None and embed is not None:
        vocab = int(embed.shape[-1])
    head_dim = int(field(reader, f"{arch}.attention.key_length") or hidden // heads)
    rotary = field(reader, f"{arch}.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise ValueError(f"{path}: partial RoPE ({rotary} of {head_dim} dims) is not supported")
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    config = {
        "model_type": ARCHITECTURES[arch], "vocab_size": int(vocab),
        "hidden_size": hidden, "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(field(reader, f"{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "torch_dtype": "float32",  # dequantized weights are fp32; load(dtype=...) casts
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
    }
    scaling = _rope_scaling(reader, arch, path)
    if scaling:
        config["rope_scaling"] = scaling
    return config


def _rope_scaling(reader: GGUFReader, arch: str, path: str | Path) -> dict | None:
    """`{arch}.rope.scaling.type` linear; Llama-3's scaling arrives as a `rope_freqs`
    tensor of per-frequency divisors, which we check against the llama3 formula."""
    kind = field(reader, f"{arch}.rope.scaling.type")
    factor = float(field(reader, f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if kind == "linear" and factor != 1.0:
        return {"rope_type": "linear", "factor": factor}
    if kind not in (None, "none", "linear"):
        raise ValueError(f"{path}: unsupported RoPE scaling {kind!r} (supported: linear, llama3)")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    divisors = torch.from_numpy(np.array(dequantize(freqs.data, freqs.tensor_type), np.float32))
    scaling = {"rope_type": "llama3", "factor": float(divisors.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return scaling if _llama3_matches(reader, arch, scaling, divisors) else _bad_freqs(path)


def _llama3_matches(reader: GGUFReader, arch: str, scaling: dict,
                    divisors: torch.Tensor) -> bool:
    base = {"model_type": "llama", "vocab_size": 1, "hidden_size": 2, "intermediate_size": 1,
            "num_hidden_layers": 1, "num_attention_heads": 1,
            "head_dim": 2 * divisors.numel(),
            "rope_theta": float(field(reader, f"{arch}.rope.freq_base", 10000.0))}
    plain = ModelConfig.from_dict(base).rope_inv_freq()
    scaled = ModelConfig.from_dict({**base, "rope_scaling": scaling}).rope_inv_freq()
    return torch.allclose(plain / scaled, divisors, rtol=1e-3)


def _bad_freqs(path: str | Path) -> dict:
    raise ValueError(f"{path}: its rope_freqs tensor does not follow Llama-3's RoPE scaling "
                     "(factor, low 1, high 4, original context 8192): not supported")


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter on attn_q / attn_k (weight (heads*D, in) or bias (heads*D,)):
    its rows per head are ordered (D/2, 2) (pairs); HF's are (2, D/2) (halves)."""
    rest = w.shape[1:]
    d = w.shape[0] // heads
    return w.reshape(heads, d // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def tensor_array(t, path: str | Path) -> np.ndarray:
    """One tensor dequantized to fp32, in numpy order (rows = output features)."""
    qtype = t.tensor_type
    if qtype not in TENSOR_TYPES:
        raise ValueError(f"{path}: tensor {t.name} has type {Q(qtype).name}, which this loader "
                         f"does not dequantize (supported: "
                         f"{', '.join(q.name for q in TENSOR_TYPES)})")
    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
    return np.asarray(dequantize(t.data, qtype), dtype=np.float32).reshape(shape)


def hf_state_dict(reader: GGUFReader, config: ModelConfig, path: str | Path,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every weight of the file under its HF name, dequantized, Q/K rows in HF order."""
    permuted = architecture(reader, path) in PERMUTED_ARCHITECTURES
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # read into the config (_rope_scaling)
            continue
        tensor = torch.from_numpy(np.array(tensor_array(t, path)))  # own, writable copy
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER:
            name = f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
            if permuted and parts[2] in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if parts[2] == "attn_q" else (
                    config.num_key_value_heads)
                tensor = unpermute_rows(tensor, heads)
        else:
            name = _OUTER.get(t.name, t.name)  # an unknown name is reported by hf_to_ours
        out[name] = tensor.to(dtype)
    return out
