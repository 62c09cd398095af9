"""Lab 6 grader: the hold-back rule, SSE framing and a token-budget admission step, against
the lab's answer key (labs/lab6_serving/lab6_reference.py) on hand-made cases and fresh
random inputs.

Graded through the `impl` fixture (tests/labs/conftest.py): a student's exercises.py under
`stack grade --lab 6`; under plain pytest the answer key. Seeds are drawn afresh
every run and printed in every failure message.

* safe_length: hand cases, then random texts and stop strings against a brute-force oracle
  (the longest end of the text that begins a stop string, shorter than that stop string);
  half of them with competing stops, each holding back a different length, in any order.
* sse_frames: every event is b"data: " + one line of JSON + b"\\n\\n", the JSON parses back
  to the chunk sent, DONE is last; an exception (as an item, or raised by the iterator)
  becomes one error event in OpenAI's shape, then DONE.
* admit: hand cases (budget, seats, chunked prefill, FCFS order, priority overtaking), then
  random queues equal to the reference's plan.
"""
from __future__ import annotations

import json
import random

import pytest

from .references import import_reference

REFERENCE = "lab6_reference"  # labs/lab6_serving/lab6_reference.py: no torch, no engine
ref = import_reference(REFERENCE)
seeds = random.SystemRandom()


# ============================================================ exercise 1: the hold-back rule
def oracle(text: str, stops) -> int:
    hold = max((k for s in stops for k in range(1, len(s)) if k <= len(text)
                and text.endswith(s[:k])), default=0)
    return len(text) - hold


@pytest.mark.points(10)
def test_safe_length_hand_cases(impl):
    cases = [("Hello wor", ["world"], 6), ("Hello", ["world"], 5), ("", ["x"], 0),
             ("abc", [], 3), ("abcab", ["abd", "b"], 3), ("ROMEO", ["ROMEO."], 0),
             ("the end", ["end of", "d"], 4), ("aaa", ["aaab"], 0),
             ("the en", ["end of", "nd"], 4), ("the en", ["nd", "end of"], 4)]
    for text, stops, want in cases:
        got = impl.safe_length(text, stops)
        assert got == want, f"safe_length({text!r}, {stops!r}) = {got}, expected {want}"


def competing_stops(rng: random.Random, alphabet: str) -> tuple[str, list[str]]:
    """A text whose end begins several stop strings, each holding back a different number
    of characters, in random order: only the longest hold is right, wherever it is listed."""
    def word(low: int, high: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(low, high)))

    long = word(3, 8)
    k = rng.randrange(2, len(long))  # the text ends with long[:k]: hold k
    text = word(0, 6) + long[:k]
    stops = [long]
    for _ in range(rng.randrange(1, 4)):  # stops that match a shorter end of the text
        j = rng.randrange(1, k)
        stops.append(text[len(text) - j:] + word(1, 4))
    rng.shuffle(stops)
    return text, stops


@pytest.mark.points(20)
def test_safe_length_random(impl):
    seed = seeds.randrange(2**32)
    rng = random.Random(seed)
    alphabet = "ab \n."
    for i in range(400):
        if i % 2:
            text, stops = competing_stops(rng, alphabet)
        else:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))
            stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 6)))
                     for _ in range(rng.randrange(0, 4))]
        got, want = impl.safe_length(text, stops), oracle(text, stops)
        assert got == want, f"seed {seed}: safe_length({text!r}, {stops!r}) = {got}, want {want}"


# ============================================================ exercise 2: SSE framing
def events(raw: list[bytes]) -> list[bytes]:
    for frame in raw:
        assert isinstance(frame, bytes), f"frames must be bytes, got {type(frame).__name__}"
    body = b"".join(raw)
    assert body.endswith(b"\n\n"), f"the stream must end with a blank line: {body[-40:]!r}"
    parts = body[:-2].split(b"\n\n")
    for p in parts:
        assert p.startswith(b"data: ") and b"\n" not in p, f"bad event framing: {p[:80]!r}"
    return [p[len(b"data: "):] for p in parts]


@pytest.mark.points(15)
def test_sse_frames_chunks_then_done(impl):
    seed = seeds.randrange(2**32)
    rng = random.Random(seed)
    chunks = [{"id": "cmpl-1", "choices": [{"index": 0, "text": rng.choice(["a", "é\n", "☃ x"]),
                                            "finish_reason": None}], "n": i}
              for i in range(rng.randrange(1, 6))]
    chunks.append({"id": "cmpl-1", "choices": [], "usage": {"completion_tokens": 3}})
    got = events(list(impl.sse_frames(iter(chunks))))
    assert got[-1] == b"[DONE]", f"seed {seed}: the last event must be [DONE], got {got[-1]!r}"
    assert [json.loads(e) for e in got[:-1]] == chunks, f"seed {seed}: chunks changed on the way"
    assert events(list(impl.sse_frames([]))) == [b"[DONE]"]


@pytest.mark.points(20)
def test_sse_frames_error_event_then_done(impl):
    def failing():
        yield {"n": 1}
        raise RuntimeError("the engine fell over")

    for items in (failing(), iter([{"n": 1}, ValueError("the engine fell over"), {"n": 2}])):
        got = events(list(impl.sse_frames(items)))
        assert got[-1] == b"[DONE]" and len(got) == 3, f"want chunk, error, DONE; got {got}"
        assert json.loads(got[0]) == {"n": 1}
        err = json.loads(got[1]).get("error")
        assert err == {"message": "the engine fell over", "type": "server_error", "param": None,
                       "code": None}, f"error event not in OpenAI's shape: {got[1]!r}"


# ============================================================ exercise 3: admission
P = ref.Pending


@pytest.mark.points(15)
def test_admit_hand_cases(impl):
    def run(waiting, **kw):
        return impl.admit([impl.Pending(*w) for w in waiting], **kw)
    # decodes take the budget first; the last admitted gets a partial chunk
    got = run([(1, 5), (2, 50)], num_running=3, max_num_seqs=8, token_budget=20)
    assert got == [(1, 5), (2, 12)], got
    # seats: 2 running + 1 admitted = 3
    assert run([(1, 1), (2, 1)], num_running=2, max_num_seqs=3, token_budget=99) == [(1, 1)]
    # no budget left after the decodes
    assert run([(1, 4)], num_running=8, max_num_seqs=16, token_budget=8) == []
    # FCFS: arrival order, not list order
    assert run([(1, 2, 0, 5), (2, 2, 0, 1)], num_running=0, max_num_seqs=4,
               token_budget=99) == [(2, 2), (1, 2)]
    # priority: lower first, ties by arrival; FCFS ignores priority
    w = [(1, 3, 5, 0), (2, 3, 5, 1), (3, 3, 0, 2)]
    assert run(w, num_running=0, max_num_seqs=2, token_budget=99,
               policy="priority") == [(3, 3), (1, 3)]
    assert run(w, num_running=0, max_num_seqs=2, token_budget=99) == [(1, 3), (2, 3)]
    with pytest.raises(ValueError):
        run(w, num_running=0, max_num_seqs=2, token_budget=9, policy="lifo")


@pytest.mark.points(20)
def test_admit_random_queues_match_the_reference(impl):
    seed = seeds.randrange(2**32)
    rng = random.Random(seed)
    for _ in range(300):
        n = rng.randrange(0, 10)
        arrivals = rng.sample(range(100), n)
        raw = [(i, rng.randrange(1, 80), rng.randrange(0, 3), arrivals[i]) for i in range(n)]
        kw = dict(num_running=rng.randrange(0, 12), max_num_seqs=rng.randrange(1, 16),
                  token_budget=rng.randrange(1, 128), policy=rng.choice(["fcfs", "priority"]))
        got = impl.admit([impl.Pending(*r) for r in raw], **kw)
        want = ref.admit([P(*r) for r in raw], **kw)
        assert got == want, f"seed {seed}: admit({raw}, {kw}) = {got}, expected {want}"
