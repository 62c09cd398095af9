"""GGUF import without any download: tiny files written here with gguf.GGUFWriter.

A random model written as llama.cpp writes it (Q8_0 / F16 tensors, Q/K rows permuted)
must load back to the same logits; bad files must fail with one clear line."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as Q

import layer3_model as l3
from layer3_model import load

from .gguf_files import CONFIG, write_model_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_model_gguf(path)


def test_round_trip_logits(tiny_gguf):
    path, reference = tiny_gguf
    model = load(path, device="cpu")
    assert model.config.num_key_value_heads == CONFIG["num_key_value_heads"]
    assert not model.config.tie_word_embeddings
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=gen)
    with torch.no_grad():
        ours, ref = model.net.causal_lm_logits(ids), reference.causal_lm_logits(ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_the_plain_reader_reads_what_ggufs_own_reads(tiny_gguf):
    """open_gguf's reader (a plain ndarray over the memory map, for speed): every field's
    value and every tensor's bytes, type and shape as gguf.GGUFReader reads them."""
    import numpy as np
    from gguf import GGUFReader

    from layer3_model.gguf_import import open_gguf

    ours, theirs = open_gguf(tiny_gguf[0]), GGUFReader(tiny_gguf[0])
    assert type(ours.data) is np.ndarray and not ours.data.flags.writeable
    assert list(ours.fields) == list(theirs.fields)
    for key, f in theirs.fields.items():
        assert ours.fields[key].contents() == f.contents(), key
    assert [(t.name, t.tensor_type, list(t.shape)) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape)) for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert np.array_equal(a.data, b.data), a.name


def test_tokenizer_and_template(tiny_gguf):
    model = load(tiny_gguf[0], device="cpu")
    tok = model.tokenizer
    assert tok.encode(" t") == [256]  # the one merge, "Ġ t" -> "Ġt"
    assert tok.decode(tok.encode("héllo 🙂  x")) == "héllo 🙂  x"
    assert tok.encode("<|im_end|>") == [259]
    assert model.eos_token_ids == (259,)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def _one_line(err: Exception) -> str:
    text = str(err)
    assert "\n" not in text
    return text


def test_truncated_and_corrupt(tiny_gguf, tmp_path):
    data = tiny_gguf[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.gguf") as err:
        load(cut, device="cpu")
    _one_line(err.value)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="junk.gguf: not a valid GGUF") as err:
        load(junk, device="cpu")
    _one_line(err.value)


def test_unknown_tensor_type(tmp_path):
    path = tmp_path / "i32.gguf"
    write_model_gguf(path, odd_type=Q.I32)
    with pytest.raises(ValueError, match="type I32") as err:
        load(path, device="cpu")
    _one_line(err.value)


def test_missing_tokenizer(tmp_path):
    path = tmp_path / "notok.gguf"
    write_model_gguf(path, tokenizer=False)
    with pytest.raises(ValueError, match="no tokenizer") as err:
        load(path, device="cpu")
    _one_line(err.value)


def test_unknown_name_and_offline_hub_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match="offline.*stack models pull") as err:
        load("some-org/some-model", device="cpu")
    _one_line(err.value)
    with pytest.raises(FileNotFoundError, match="does not exist: it is not a directory"):
        load("no-such-model", device="cpu")


def test_local_path_wins_over_hub_id(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").mkdir()
    (tmp_path / "org" / "model" / "m.gguf").write_bytes(tiny_gguf[0].read_bytes())
    assert load("org/model", device="cpu").config.hidden_size == CONFIG["hidden_size"]


def test_cli_errors_are_one_line(tiny_gguf, tmp_path):
    """`stack models info` on a corrupt file and `stack run --layer 3` with an offline hub
    id: `error: ...` on one line, exit 2, no traceback."""
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x00" * 40)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    for argv in (["models", "info", str(junk)], ["run", "--layer", "3", "--model", "a-b/c-d"]):
        done = subprocess.run([sys.executable, "-m", "layer7_app.cli", *argv], env=env,
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr


def test_shape_names_are_random_weights():
    """"smollm2-shape": SmolLM2-135M's shape with random weights, no tokenizer."""
    from layer3_model.registry import SHAPES

    model = load("smollm2-shape", device="cpu")
    assert model.tokenizer is None and model.config.num_hidden_layers == 30
    assert model.config.vocab_size == SHAPES["smollm2-shape"]["vocab_size"]
    assert model.generate([[1, 2, 3]], l3.SamplingParams(max_tokens=2, temperature=0.0))
