"""Layer 6 stream deltas (no server): what the tracker sends, token by token, through
layer 3's FinishRule with the course tokenizer: stop strings split across tokens never leak,
multi-byte characters are never split, EOS flushes, finish reasons are sent once."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

import layer6_serving as l6
from layer6_serving.streams import DeltaTracker

l4 = l6.parallel.engine
l3 = l4.executor
SP = l6.parallel.SamplingParams
TOK = l3.Tokenizer.from_pretrained(l3.course_model_dir("target"))
EOS = 1


@dataclass
class Out:  # the fields of layer 4's CompletionOutput the tracker reads
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list | None = None


def tracker() -> DeltaTracker:
    return DeltaTracker(lambda t: TOK.decode([t]))


def engine_view(ids: list[int], params) -> list[Out]:
    """What the engine reports after each token: layer 4's Sequence (the FinishRule) fed the
    ids one by one: its output ids, released text and finish reason."""
    seq, views = l4.Sequence(0, "r", [2], params, decoder=TOK.decoder(), eos_token_ids=(EOS,)), []
    for t in ids:
        done = seq.append_token(t)
        views.append(Out(0, list(seq.output_ids), seq.safe_text, seq.finish_reason))
        if done:
            break
    return views


def stream(ids: list[int], params, step: int = 1) -> tuple[str, list[str], str | None]:
    tr, pieces, reason = tracker(), [], None
    views = engine_view(ids, params)
    for k in range(0, len(views), step):
        for d in tr.update([views[min(k + step, len(views)) - 1]]):
            pieces.append(d.text)
            reason = d.finish_reason or reason
    return "".join(pieces), pieces, reason


@pytest.mark.parametrize("seed", range(12))
def test_stop_string_never_leaks_even_split_across_tokens(seed):
    rng = random.Random(seed)
    stop = rng.choice(["\n\n", "ROMEO.", "the end", "lord, my"])
    body = "".join(rng.choice(["a ", "b", " ", "\n", "RO", "ME", "O", "the", " en", "lord", ", "])
                   for _ in range(30))
    full = body + stop + " tail that must not appear"
    want = full[:full.index(stop)]
    ids = TOK.encode(full, add_special_tokens=False)
    sent, pieces, reason = stream(ids, SP(max_tokens=500, stop=(stop,)), step=rng.choice([1, 3]))
    assert sent == want and reason == "stop"
    shown = ""
    for p in pieces:  # at no point does the client hold text past the cut
        shown += p
        assert want.startswith(shown)


def test_multibyte_characters_are_never_split():
    text = "naïve — ☃ 日本語 ✓ é"
    ids = TOK.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # byte-level pieces: some characters span tokens
    sent, pieces, reason = stream(ids, SP(max_tokens=len(ids)))
    assert sent == text and reason == "length"
    assert not any("\ufffd" in p for p in pieces)


def test_eos_flushes_and_finish_reason_is_sent_once():
    ids = TOK.encode("Good night.", add_special_tokens=False)
    views = engine_view(ids + [EOS], SP(max_tokens=50))
    tr = tracker()
    first = tr.update([views[0]])
    assert first[0].finish_reason is None
    last = tr.update([views[-1]])  # EOS is not among the ids: the engine drops it
    assert views[-1].token_ids == ids
    assert "".join(d.text for d in first + last) == "Good night."
    assert [d.finish_reason for d in last] == ["stop"]
    assert tr.update([views[-1]]) == []


def test_parallel_completions_are_tracked_apart():
    a, b = (TOK.encode(t, add_special_tokens=False) for t in ("To be", "or not"))
    tr = tracker()
    ds = tr.update([Out(0, a, "To be", "length"), Out(1, b[:1], "or", None)])
    assert [(d.index, d.finish_reason) for d in ds] == [(0, "length"), (1, None)]
    ds = tr.update([Out(0, a, "To be", "length"), Out(1, b, "or not", "length")])
    assert [d.index for d in ds] == [1] and ds[0].text == " not"


def test_logprobs_get_their_token_text():
    lp = l4.logits_processing.TokenLogprobs(5, -0.5, [(5, -0.5), (7, -1.5)])
    ds = tracker().update([Out(0, [5], "x", None, [lp])])
    got = ds[0].logprobs[0]
    assert (got.token_id, got.token, got.logprob) == (5, TOK.decode([5]), -0.5)
    assert got.top == [(5, TOK.decode([5]), -0.5), (7, TOK.decode([7]), -1.5)]
