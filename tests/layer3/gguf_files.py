"""Tiny GGUF files written with gguf.GGUFWriter, as llama.cpp's converter writes them:
a random layer-3 model's tensors (Q8_0 matrices, an F16 embedding, F32 norms), the rows of
attn_q / attn_k permuted per head, and a small byte-level BPE tokenizer."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

from layer3_model import ModelConfig, random_model
from layer3_model.weights import ours_to_hf

CONFIG = {"model_type": "llama", "vocab_size": 260, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64,
          "tie_word_embeddings": False}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_OUTER = {"model.embed_tokens.weight": "token_embd.weight",
          "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def byte_tokens() -> list[str]:
    """GPT-2's byte alphabet (the 256 single-byte tokens, spelled as printable chars)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out, n = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + n))
            n += 1
    return out


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from halves (2, D/2) to pairs (D/2, 2)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def gguf_name(hf: str) -> str:
    if hf in _OUTER:
        return _OUTER[hf]
    parts = hf.split(".")  # model.layers.i.<block>.<proj>.weight
    local = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{_HF_TO_GGUF[local]}.{parts[-1]}"


def write_model_gguf(path: Path, *, seed: int = 0, tokenizer: bool = True,
                     odd_type: Q | None = None) -> torch.nn.Module:
    """Write a random model as GGUF; return the reference network holding the weights
    exactly as the file stores them (quantized, then dequantized)."""
    config = ModelConfig.from_dict(CONFIG)
    net = random_model(config, seed=seed, std=0.2)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    if tokenizer:
        tokens = byte_tokens() + ["Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([1] * 257 + [3, 3, 3])
        w.add_token_merges(["Ġ t"])
        w.add_bos_token_id(258)
        w.add_eos_token_id(259)
        w.add_chat_template(TEMPLATE)
    stored = {}
    for name, tensor in ours_to_hf(net).items():
        arr = tensor.float().numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else (
                config.num_key_value_heads)
            arr = llama_permute(arr, heads)
        if arr.ndim == 1:
            data, back = arr, arr
        elif name == "model.embed_tokens.weight":
            data = arr.astype(np.float16)
            back = data.astype(np.float32)
        else:
            qtype = odd_type if (odd_type is not None and "down_proj" in name) else Q.Q8_0
            if qtype == Q.I32:
                data, back = np.zeros(arr.shape, np.int32), arr
            else:
                data = quantize(arr, qtype)
                back = dequantize(data, qtype).reshape(arr.shape)
            w.add_tensor(gguf_name(name), data, raw_dtype=qtype)
            stored[name] = back
            continue
        w.add_tensor(gguf_name(name), data)
        stored[name] = back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # The reference: stored values with the permutation undone (HF order again).
    for name in ("q_proj", "k_proj"):
        for key in [k for k in stored if f"{name}.weight" in k]:
            heads = config.num_attention_heads if name == "q_proj" else (
                config.num_key_value_heads)
            d = stored[key].shape[0] // heads
            stored[key] = stored[key].reshape(heads, d // 2, 2, -1).swapaxes(1, 2).reshape(
                stored[key].shape)
    from layer3_model.weights import hf_to_ours

    state = hf_to_ours({k: torch.from_numpy(np.array(v)) for k, v in stored.items()}, net)
    net.load_state_dict(state, strict=False)
    return net
