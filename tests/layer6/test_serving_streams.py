"""Layer 6 stream deltas: the stop-string hold-back and multi-byte characters (no server)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

import layer6_serving as l6
from layer6_serving.streams import DeltaTracker

l3 = l6.parallel.engine.executor


@dataclass
class Out:  # the fields of layer 4's CompletionOutput the tracker reads
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None


def test_safe_length_holds_back_only_stop_prefixes():
    assert l6.safe_length("Hello wor", ("world",)) == len("Hello ")
    assert l6.safe_length("Hello", ("world",)) == 5
    assert l6.safe_length("abcab", ("abd", "b")) == 3  # "ab" may start "abd"
    assert l6.safe_length("", ("x",)) == 0
    assert l6.safe_length("text", ()) == 4


def _engine_texts(pieces: list[str], stop: str) -> tuple[list[str], str]:
    """The text the engine holds after each token, cutting at the stop string as layer 4
    does; and the final text."""
    texts, text = [], ""
    for p in pieces:
        text += p
        i = text.find(stop)
        if i >= 0:
            texts.append(text[:i])
            return texts, text[:i]
        texts.append(text)
    return texts, text


@pytest.mark.parametrize("seed", range(20))
def test_stop_string_never_leaks_even_split_across_tokens(seed):
    rng = random.Random(seed)
    stop = rng.choice(["\n\n", "ROMEO.", "the end", "xyz"])
    body = "".join(rng.choice(["a", "b", " ", "\n", "RO", "ME", "O", "the", " en", "x", "y"])
                   for _ in range(30))
    full = body + stop + "tail that must not appear"
    cuts = sorted(rng.sample(range(1, len(full)), 12))
    pieces = [full[i:j] for i, j in zip([0] + cuts, cuts + [len(full)], strict=True)]
    texts, final = _engine_texts(pieces, stop)
    tr, sent = DeltaTracker((stop,), False), ""
    for k, t in enumerate(texts):
        done = k == len(texts) - 1
        for d in tr.update([Out(0, list(range(k + 1)), t, "stop" if done else None)]):
            sent += d.text
            assert final.startswith(sent), f"sent {sent!r} is not a prefix of {final!r}"
    assert sent == final and stop not in sent


def test_multibyte_characters_are_never_split():
    tok = l3.Tokenizer.from_pretrained(l3.course_model_dir("target"))
    text = "naïve — ☃ 日本語 ✓ é"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # byte-level pieces: some characters span tokens
    dec, tr, sent, seen = tok.decoder(), DeltaTracker((), False), "", ""
    for k, t in enumerate(ids):
        seen += dec.step(t)
        last = k == len(ids) - 1
        if last:
            seen += dec.flush()
        for d in tr.update([Out(0, ids[:k + 1], seen, "length" if last else None)]):
            assert "\ufffd" not in d.text
            sent += d.text
    assert sent == text


def test_finish_reason_sent_once_and_mapped():
    tr = DeltaTracker((), False)
    assert tr.update([Out(0, [1], "a", None)])[0].finish_reason is None
    d = tr.update([Out(0, [1, 2], "ab", "eos")])
    assert [(x.text, x.finish_reason) for x in d] == [("b", "stop")]
    assert tr.update([Out(0, [1, 2], "ab", "eos")]) == []
