"""The tokenizer a GGUF file describes (`tokenizer.ggml.*`), as a `tokenizers` Tokenizer.

A GGUF file has no tokenizer.json: it stores the pieces. For a byte-level BPE vocabulary
(`tokenizer.ggml.model == "gpt2"`, GPT-2 / Llama-3 / Qwen / SmolLM style):
- `tokens` (id -> token, spelled in GPT-2's byte alphabet, "Ġ" for a space) and `merges`
  ("a b" pairs, in priority order) make the BPE model;
- `token_type` marks CONTROL tokens (3: `<|im_end|>`, never split, skipped when decoding)
  and USER_DEFINED ones (4: matched whole, kept in the text);
- `pre` names the pre-tokenizer, the regex that cuts text into words before BPE. We follow
  llama.cpp's table for the names we know ("smollm" first isolates every digit, then the
  GPT-2 regex); an unknown name is an error rather than a silently different tokenization;
- `bos_token_id`, `eos_token_id`, `padding_token_id`, `add_bos_token` (BOS prepended when
  encoding), and `tokenizer.chat_template`.
"""
from __future__ import annotations

from pathlib import Path

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from .gguf_import import field
from .tokenizer import Tokenizer

_CONTROL, _USER_DEFINED = 3, 4
_GPT2 = None  # ByteLevel's own regex
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (isolate each digit first?, split regex or None for GPT-2's).
PRE_TOKENIZERS = {
    "default": (False, _GPT2), "gpt2": (False, _GPT2), "gpt-2": (False, _GPT2),
    "smollm": (True, _GPT2), "starcoder": (True, _GPT2), "refact": (True, _GPT2),
    "codeshell": (True, _GPT2),
    "llama3": (False, _LLAMA3), "llama-v3": (False, _LLAMA3), "llama-bpe": (False, _LLAMA3),
    "smaug-bpe": (False, _LLAMA3), "dbrx": (False, _LLAMA3),
    "qwen2": (False, _QWEN2), "deepseek-r1-qwen": (False, _QWEN2),
}


def _pre_tokenizer(pre: str, path: str | Path):
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{path}: unsupported tokenizer.ggml.pre {pre!r} (known: "
                         f"{', '.join(PRE_TOKENIZERS)})")
    digits, regex = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if regex is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def gguf_tokenizer(reader: GGUFReader, path: str | Path) -> Tokenizer:
    """Layer 3's Tokenizer built from the file's metadata. ValueError naming the file when it
    has no tokenizer or one of a kind this loader does not build."""
    kind = field(reader, "tokenizer.ggml.model")
    if kind is None or field(reader, "tokenizer.ggml.tokens") is None:
        raise ValueError(f"{path}: the file has no tokenizer (no tokenizer.ggml.model / "
                         "tokenizer.ggml.tokens metadata); pass token ids, or use a file "
                         "converted with its tokenizer")
    if kind != "gpt2":
        raise ValueError(f"{path}: unsupported tokenizer.ggml.model {kind!r}: this loader "
                         "builds byte-level BPE ('gpt2') tokenizers")
    tokens: list[str] = list(field(reader, "tokenizer.ggml.tokens"))
    merges = field(reader, "tokenizer.ggml.merges")
    if not merges:
        raise ValueError(f"{path}: byte-level BPE tokenizer without tokenizer.ggml.merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(str(field(reader, "tokenizer.ggml.pre", "default")), path)
    tok.decoder = decoders.ByteLevel()
    types = list(field(reader, "tokenizer.ggml.token_type") or [])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types, strict=False) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types, strict=False) if k == _USER_DEFINED])

    def token(key: str) -> str | None:
        i = field(reader, f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    if field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    template = field(reader, "tokenizer.chat_template")
    return Tokenizer(tok, bos_token=bos, eos_tokens=(eos,) if eos else (),
                     chat_template=None if template is None else str(template))
