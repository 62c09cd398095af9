"""A byte-level BPE tokenizer for the course model, trained with `tokenizers`.

Byte-level means any text encodes (unknown characters fall back to bytes) and decoding
gives the text back exactly. The vocabulary is small (4096 by default): the corpus is
4 MB of Shakespeare, and a small vocabulary keeps the embedding table, which dominates a
1M-parameter draft model, small.

The chat template renders a conversation as a scene: every message is a speech
`NAME.\\ntext\\n\\n`, the user speaking as `user_name` (default HORATIO), the assistant
as `assistant_name` (default HAMLET), a system message as the CHORUS, and a message's
own `name` overriding either. The generation prompt is the assistant's heading
`HAMLET.\\n`; generation should stop at the blank line that ends a speech ("\\n\\n").

    python -m layer3_model.training.tokenizer --data DIR          # writes DIR/tokenizer/
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .data import cache_dir, load_split

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2: the trainer adds them first
DEFAULT_USER, DEFAULT_ASSISTANT, SYSTEM_SPEAKER = "HORATIO", "HAMLET", "CHORUS"
STOP_STRINGS = ("\n\n",)  # a speech ends at a blank line
# One line of jinja2 with explicit '\n' so it renders the same whatever the environment's
# trim_blocks / lstrip_blocks settings (Hugging Face sets both, plain jinja2 neither).
CHAT_TEMPLATE = (
    "{%- set user = user_name | default('" + DEFAULT_USER + "', true) -%}"
    "{%- set assistant = assistant_name | default('" + DEFAULT_ASSISTANT + "', true) -%}"
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['name'] is defined and message['name'] -%}{%- set speaker = message['name'] -%}"
    "{%- elif message['role'] == 'user' -%}{%- set speaker = user -%}"
    "{%- elif message['role'] == 'assistant' -%}{%- set speaker = assistant -%}"
    "{%- elif message['role'] == 'system' -%}{%- set speaker = '" + SYSTEM_SPEAKER + "' -%}"
    "{%- else -%}{%- set speaker = message['role'] -%}{%- endif -%}"
    "{{- speaker | trim | upper -}}{{- '.\\n' -}}{{- message['content'] | trim -}}{{- "
    "'\\n\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- assistant | trim | upper -}}{{- '.\\n' -}}{%- endif -%}"
)


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2
) -> Tokenizer:
    """Train a byte-level BPE on `texts` (an iterable of documents, e.g. plays)."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} is below the 256 bytes + "
                         f"{len(SPECIAL_TOKENS)} special tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config(model_max_length: int) -> dict[str, object]:
    """tokenizer_config.json: what transformers' AutoTokenizer and our executor read."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False, "add_eos_token": False,  # the chat template writes bos itself
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, out: Path, model_max_length: int = 512) -> Path:
    """Write out/tokenizer.json and out/tokenizer_config.json; returns `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model_max_length), indent=2) + "\n"
    )
    return out


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """{"bos": id, "eos": id, "pad": id}: raises if the tokenizer lacks one."""
    ids = {
        name: tok.token_to_id(t)
        for name, t in zip(("bos", "eos", "pad"), SPECIAL_TOKENS, strict=True)
    }
    missing = [SPECIAL_TOKENS[i] for i, v in enumerate(ids.values()) if v is None]
    if missing:
        raise ValueError(f"tokenizer has no {', '.join(missing)}: not trained by "
                         "training.tokenizer?")
    return ids


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = True,
                template: str = CHAT_TEMPLATE, **names: str) -> str:
    """Render `messages` with the chat template in plain jinja2 (names: user_name,
    assistant_name)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment()
    return env.from_string(template).render(messages=messages, bos_token=BOS, eos_token=EOS,
                                            add_generation_prompt=add_generation_prompt, **names)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=cache_dir() / "prepared",
                    help="prepared-data dir (train.txt)")
    ap.add_argument("--out", type=Path, default=None, help="default: DATA/tokenizer")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--max-length", type=int, default=512, help="model_max_length to record")
    args = ap.parse_args(argv)
    plays = load_split(args.data, "train")  # validation plays stay unseen, even by the tokenizer
    tok = train_tokenizer(plays, vocab_size=args.vocab)
    out = save_tokenizer(tok, args.out or args.data / "tokenizer", args.max_length)
    n_tokens = sum(len(e.ids) for e in tok.encode_batch(plays))
    chars = sum(len(p) for p in plays)
    print(f"vocab {tok.get_vocab_size()}; train split: {chars:,} chars -> {n_tokens:,} tokens "
          f"({chars / n_tokens:.2f} chars/token); wrote {out}")


if __name__ == "__main__":
    main()
