"""Text <-> token ids with a Hugging Face `tokenizer.json`, chat templates, streaming decode.

- `tokenizers.Tokenizer` does the encoding (its post-processor adds BOS where the model
  wants it).
- The chat template (a Jinja program in tokenizer_config.json's "chat_template", or a
  chat_template.jinja file) turns [{"role": ..., "content": ...}] into the prompt text. It
  runs in jinja2's sandbox: a checkpoint is data, and its template must not reach Python.
- Streaming: a byte-level BPE token can hold half of a UTF-8 character ("é" may be two
  tokens). `IncrementalDecoder` decodes a small window of recent tokens and holds text
  back while it ends in U+FFFD (the decoder's mark for incomplete bytes), so every delta
  it returns is final and the deltas concatenate to the full decode.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REPLACEMENT = "\ufffd"


def _token_text(value: object) -> str | None:
    """tokenizer_config.json writes special tokens as "<s>" or {"content": "<s>", ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    """A tokenizer.json model plus the special tokens and chat template a checkpoint declares."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_tokens: tuple[str, ...] = (), chat_template: str | None = None,
                 extra_eos_ids: tuple[int, ...] = ()) -> None:
        self.tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.bos_token_id = None if bos_token is None else tokenizer.token_to_id(bos_token)
        ids = [tokenizer.token_to_id(t) for t in eos_tokens] + list(extra_eos_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in ids if i is not None))
        self.chat_template = chat_template
        self._token_texts: dict[tuple[int, bool], str] = {}  # token_text's, filled as used

    @classmethod
    def from_pretrained(cls, path: str | Path, *, extra_eos_ids: tuple[int, ...] = ()) -> Tokenizer:
        """tokenizer.json (required), tokenizer_config.json and chat_template.jinja (optional)."""
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path} (the "
                                    "`tokenizers` format is needed)")
        cfg_file = file.parent / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = file.parent / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        eos = _token_text(cfg.get("eos_token"))
        return cls(
            tokenizers.Tokenizer.from_file(str(file)),
            bos_token=_token_text(cfg.get("bos_token")),
            eos_tokens=(eos,) if eos else (),
            chat_template=template,
            extra_eos_ids=extra_eos_ids,
        )

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int, *, skip_special_tokens: bool = True) -> str:
        """decode([token_id]), remembered (at most one string per vocabulary entry): the
        incremental decoder's window before its newest token is one token most steps."""
        key = (token_id, skip_special_tokens)
        text = self._token_texts.get(key)
        if text is None:
            text = self._token_texts[key] = self.decode([token_id],
                                                        skip_special_tokens=skip_special_tokens)
        return text

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            **kwargs: object) -> str:
        """Render messages with the checkpoint's template. The text usually starts with the
        BOS token already: encode it with add_special_tokens=False (see encode_chat)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json has no "
                             "'chat_template' and there is no chat_template.jinja)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt),
            add_special_tokens=False,
        )

    def decoder(self, *, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    """Token ids in, final text deltas out. Keeps two offsets into the ids: `prefix` (where
    the decode window starts: a few tokens of context, so decoders that treat the first
    token specially, such as a leading-space marker, see the same start twice) and `read`
    (the ids whose text was already emitted)."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""
        self._before: str | None = ""  # the text of ids[prefix:read] (None: not decoded yet)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.tok.decode(ids, skip_special_tokens=self.skip)  # ids: a fresh list

    def step(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is unfinished)."""
        self.ids.append(int(token_id))
        if self._before is None:  # decoded once per move of the offsets, not once per token
            if self.read - self.prefix == 1:  # usually: the token emitted last
                self._before = self.tokenizer.token_text(self.ids[self.prefix],
                                                         skip_special_tokens=self.skip)
            else:
                self._before = self._decode(self.ids[self.prefix:self.read])
        before = self._before
        now = self._decode(self.ids[self.prefix:])
        if len(now) <= len(before) or now.endswith(_REPLACEMENT) or not now.startswith(before):
            return ""
        self.prefix, self.read, self._before = self.read, len(self.ids), None
        delta = now[len(before):]
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever is still held back (an unfinished character stays U+FFFD)."""
        full = self._decode(self.ids)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        self.prefix = self.read = len(self.ids)
        self._before = ""
        return delta


def encode_prompt(prompt: str | Sequence[int], tokenizer: Tokenizer | None,
                  vocab_size: int) -> list[int]:
    """A prompt (text, or token ids) -> token ids, checked: ValueError for text without a
    tokenizer, an empty prompt, or an id outside [0, vocab_size). Layer 3's Model.encode and
    layer 6's server (which holds a tokenizer but no model) both use it."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
        ids = tokenizer.encode(prompt)
    else:
        ids = list(map(int, prompt))  # (half a comprehension's time: 2k-token prompts)
    if not ids:
        raise ValueError("empty prompt: the model needs at least one token to condition on")
    if max(ids) >= vocab_size or min(ids) < 0:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    return ids
