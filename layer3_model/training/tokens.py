"""Tokenize the prepared plays once, to uint16 .npy files that training memory-maps.

DATA/tokens/{train,val}.npy hold every play as <|bos|> play <|eos|>, concatenated;
DATA/tokens/meta.json records the tokenizer's hash (a different tokenizer re-tokenizes),
the special ids and the counts. The folder is small (~3 MB) and is all the GPU machine
needs besides the tokenizer: carry it there instead of the text.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from .data import load_split
from .tokenizer import special_token_ids


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tokenize_plays(tok: Tokenizer, plays: list[str]) -> np.ndarray:
    """(n_tokens,) uint16: each play framed by bos and eos."""
    ids = special_token_ids(tok)
    if tok.get_vocab_size() > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"vocab of {tok.get_vocab_size()} does not fit uint16 token files")
    out: list[int] = []
    for enc in tok.encode_batch(plays):
        out += [ids["bos"], *enc.ids, ids["eos"]]
    return np.asarray(out, dtype=np.uint16)


def load_tokens(
    data_dir: Path, tokenizer_dir: Path
) -> tuple[np.ndarray, np.ndarray, dict[str, object]]:
    """(train tokens, val tokens, meta), memory-mapped; tokenizes DATA/{train,val}.txt if needed."""
    data_dir, tok_file = Path(data_dir), Path(tokenizer_dir) / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"{tok_file} is missing: run `python -m "
                                "layer3_model.training.tokenizer "
                                f"--data {data_dir}` first")
    tok_dir = data_dir / "tokens"
    meta_file = tok_dir / "meta.json"
    sha = _sha256(tok_file)
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    fresh = meta.get("tokenizer_sha256") == sha and all(
        (tok_dir / f"{s}.npy").is_file() for s in ("train", "val"))
    if not fresh:
        tok = Tokenizer.from_file(str(tok_file))
        tok_dir.mkdir(parents=True, exist_ok=True)
        meta = {
            "tokenizer_sha256": sha,
            "vocab_size": tok.get_vocab_size(),
            **special_token_ids(tok),
        }
        for split in ("train", "val"):
            plays = load_split(data_dir, split)
            arr = tokenize_plays(tok, plays)
            np.save(tok_dir / f"{split}.npy", arr)
            meta[f"{split}_plays"], meta[f"{split}_tokens"] = len(plays), int(arr.size)
            meta[f"{split}_chars"] = sum(len(p) for p in plays)
        meta_file.write_text(json.dumps(meta, indent=2) + "\n")
    train = np.load(tok_dir / "train.npy", mmap_mode="r")
    val = np.load(tok_dir / "val.npy", mmap_mode="r")
    return train, val, meta
