"""`load_gguf(path)`: a `.gguf` file -> (LlamaModel, Tokenizer), as load() does for a HF dir.

The metadata becomes a ModelConfig (gguf_import.hf_config), the tensors are dequantized
under their HF names (gguf_import.hf_state_dict) and go through the same renaming, merging
and name/shape checks as a safetensors checkpoint (weights.hf_to_ours).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .config import ModelConfig
from .meta_init import meta_device
from .model import LlamaModel
from .tokenizer import Tokenizer
from .weights import hf_to_ours


def gguf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig a GGUF file describes (reads the header only)."""
    from .gguf_import import hf_config, open_gguf  # the gguf package only when a file is read
    return ModelConfig.from_dict(hf_config(open_gguf(path), path))


def load_gguf(path: str | Path, *, backend: str = "torch", dtype: torch.dtype | None = None,
              device: torch.device | str | None = None) -> tuple[LlamaModel, Tokenizer]:
    """The network (dequantized to `dtype`, default fp32, on `device`) and its tokenizer.
    ValueError naming the file for an unsupported architecture or tensor type, a corrupt or
    truncated file, or a missing tokenizer."""
    from .gguf_import import hf_config, hf_state_dict, open_gguf
    from .gguf_tokenizer import gguf_tokenizer

    reader = open_gguf(path)
    config = ModelConfig.from_dict(hf_config(reader, path))
    tokenizer = gguf_tokenizer(reader, path)  # first: a file without one fails fast
    dtype = dtype or config.torch_dtype
    device = torch.device(device or "cpu")
    with meta_device():
        model = LlamaModel(config, backend=backend)
    try:
        ours = hf_to_ours(hf_state_dict(reader, config, path, dtype), model)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    model.load_state_dict({k: v.to(device) for k, v in ours.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.init_rope(device)
    return model.eval(), tokenizer
