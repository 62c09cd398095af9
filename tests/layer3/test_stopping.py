"""FinishRule, the one finish rule: fed one token at a time, checked against a reference that
sees the whole text at once. Tokens here are UTF-8 bytes (a multi-byte character spans 2-4
tokens, a stop string as many tokens as it has bytes), decoded by Python's incremental UTF-8
decoder; one test uses the course tokenizer's IncrementalDecoder."""
from __future__ import annotations

import codecs
import random

import pytest

import layer3_model as l3

EOS = 300  # not a byte: the byte tokens are 0..255
ALPHABET = "ab \nxé日🙂"  # 1-, 2-, 3- and 4-byte characters


class ByteDecoder:
    """Token = one UTF-8 byte; step returns the characters it completes."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token: int) -> str:
        return self._dec.decode(bytes([token]))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


def feed(rule: l3.FinishRule, tokens: list[int], shown: str = "") -> list[str]:
    """Feed until finished; every piece must extend what was shown, never take it back."""
    pieces = []
    for t in tokens:
        piece, reason = rule.append(t)
        pieces.append(piece)
        assert rule.text.startswith(shown + "".join(pieces))
        if reason is not None:
            break
    return pieces


def reference(text: str, stops: tuple[str, ...], max_tokens: int) -> tuple[str, str | None]:
    """(final text, finish reason) from the whole text (no EOS in it): the output ends at
    the first character that completes a stop string, cut where the earliest match in it
    begins."""
    data = text.encode()
    shown = data[:max_tokens].decode("utf-8", errors="replace")
    for end in range(1, len(shown) + 1):
        cut = [i for s in stops if (i := shown[:end].find(s)) >= 0]
        if cut:
            return shown[: min(cut)], "stop"
    return shown, ("length" if len(data) >= max_tokens else None)


@pytest.mark.parametrize("seed", range(40))
def test_random_texts_and_stop_strings_match_the_whole_text_reference(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 30)))
    stops = []
    for _ in range(rng.randint(0, 3)):  # substrings of the text (they occur) or random ones
        if rng.random() < 0.6:
            i = rng.randrange(len(text))
            stops.append(text[i:i + rng.randint(1, 4)])
        else:
            stops.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 3))))
    max_tokens = rng.randint(1, 2 * len(text.encode()) + 1)
    params = l3.SamplingParams(max_tokens=max_tokens, stop=tuple(stops))
    rule = l3.FinishRule(params, (EOS,), ByteDecoder())
    pieces = feed(rule, list(text.encode()))
    want_text, want_reason = reference(text, params.stop, max_tokens)
    assert (rule.text, rule.finish_reason) == (want_text, want_reason)
    if rule.finished:
        assert "".join(pieces) == want_text  # everything shown once finished
    for s in params.stop:
        assert s not in "".join(pieces)


def test_stop_string_split_across_tokens_is_held_back_and_never_shown():
    params = l3.SamplingParams(max_tokens=100, stop=("日🙂",))  # 3 + 4 bytes: 7 tokens
    rule = l3.FinishRule(params, (EOS,), ByteDecoder())
    tokens = list("ab日".encode())
    pieces = feed(rule, tokens)
    assert "".join(pieces) == "ab" and rule.text == "ab日"  # "日" may begin the stop string
    pieces += feed(rule, list("🙂x".encode()), "".join(pieces))
    assert rule.finish_reason == "stop" and rule.text == "ab" and "".join(pieces) == "ab"
    assert rule.token_ids == tokens + list("🙂".encode())  # the last byte of 🙂 finished it


def test_held_text_is_released_when_the_stop_string_does_not_follow():
    params = l3.SamplingParams(max_tokens=100, stop=("abc",))
    rule = l3.FinishRule(params, (EOS,), ByteDecoder())
    assert feed(rule, list(b"xab")) == ["x", "", ""]  # "ab" could become "abc"
    assert feed(rule, list(b"d"), "x") == ["abd"]
    assert rule.finish_reason is None


def test_multibyte_character_split_across_tokens_is_emitted_whole():
    rule = l3.FinishRule(l3.SamplingParams(max_tokens=100), (EOS,), ByteDecoder())
    assert feed(rule, list("🙂".encode())) == ["", "", "", "🙂"]


def test_eos_finishes_without_the_token_and_flushes_held_text():
    params = l3.SamplingParams(max_tokens=100, stop=("abc",))
    rule = l3.FinishRule(params, (EOS,), ByteDecoder())
    pieces = feed(rule, list(b"xab") + [EOS, 120])
    assert rule.finish_reason == "eos" and rule.token_ids == list(b"xab")
    assert "".join(pieces) == rule.text == "xab"  # the held "ab" is shown at the end
    ignoring = l3.FinishRule(l3.SamplingParams(max_tokens=2, ignore_eos=True), (1,), None)
    assert feed(ignoring, [1, 1]) == ["", ""] and ignoring.finish_reason == "length"


def test_max_tokens_flushes_an_unfinished_character():
    rule = l3.FinishRule(l3.SamplingParams(max_tokens=3), (EOS,), ByteDecoder())
    pieces = feed(rule, list("a🙂".encode()))  # 'a' and 2 of the emoji's 4 bytes
    assert rule.finish_reason == "length" and len(rule.token_ids) == 3
    assert "".join(pieces) == rule.text == "a\ufffd"


def test_feeding_a_finished_rule_is_refused_and_no_decoder_means_no_text():
    rule = l3.FinishRule(l3.SamplingParams(max_tokens=1, stop=("a",)), (EOS,), None)
    assert rule.append(97) == ("", "length") and rule.text == ""
    with pytest.raises(ValueError, match="already finished"):
        rule.append(97)


def test_course_tokenizer_streams_the_same_text_as_generate_would_return():
    tok = l3.Tokenizer.from_pretrained(l3.course_model_dir("target"))
    text = "ROMEO.\nBut soft, what light through yonder window breaks?\n\nJULIET.\n"
    tokens = tok.encode(text)
    params = l3.SamplingParams(max_tokens=len(tokens), stop=("\n\n",))
    rule = l3.FinishRule(params, (), tok.decoder())
    pieces = feed(rule, tokens)
    assert rule.finish_reason == "stop"
    assert "".join(pieces) == rule.text == text[: text.index("\n\n")]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("text", [True, False])
def test_add_leaves_the_state_append_leaves(seed, text):
    """add(token) (the engine's call: no piece returned) and append(token) agree token by
    token: ids, text, released characters, finish reason; with and without a decoder."""
    rng = random.Random(seed)
    stops = tuple(rng.choice(["a", "b x", "é"]) for _ in range(rng.randint(0, 2)))
    params = l3.SamplingParams(max_tokens=rng.randint(1, 20), stop=stops,
                               ignore_eos=rng.random() < 0.3)
    rules = [l3.FinishRule(params, (EOS,), ByteDecoder() if text else None) for _ in range(2)]
    eos = [] if params.ignore_eos and text else [EOS]  # (ignored, it is decoded: not a byte)
    for t in [rng.choice([*b"ab x", *"é".encode(), *eos]) for _ in range(30)]:
        _, want = rules[0].append(t)
        assert rules[1].add(t) == want
        a, b = rules
        assert (a.token_ids, a.text, a.emitted, a.finish_reason) == \
            (b.token_ids, b.text, b.emitted, b.finish_reason)
        if want is not None:
            break
