"""The SSE fast path (ChunkMaker.payload renders a step's chunks from a template) against the
plain one (the chunk dicts, framed): byte for byte equal on random outputs, both endpoints,
with and without usage, awkward text (quotes, backslashes, newlines, control and non-ASCII
characters), several completions, a completion finishing before the request does."""
from __future__ import annotations

import json
import random

import pytest

from layer6_serving.api.render import ChunkMaker, frame
from layer6_serving.streams import Delta, RequestMetricsSummary, StreamOutput, TokenLogprob

ALPHABET = ['a', ' ', '"', '\\', '\n', '\t', '\x00', '\x1f', 'é', '日', '☃', '😀', '</', "'", '{}']


def plain(maker: ChunkMaker, out: StreamOutput) -> bytes:
    return b"".join(frame(c) for c in maker.chunks(out))


def random_output(rng: random.Random, finished: bool, logprobs: bool) -> StreamOutput:
    deltas = []
    for index in rng.sample(range(5), rng.randint(0, 3)):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6)))
        lps = None
        if logprobs:
            lps = [TokenLogprob(7, "x", -0.5, [(7, "x", -0.5), (8, '"', -1.25)])]
        reason = rng.choice([None, None, "stop", "length"])
        deltas.append(Delta(index, [rng.randrange(100)], text, lps, reason))
    metrics = RequestMetricsSummary(0.01, 50.0, 3, None) if finished else None
    return StreamOutput("r", deltas, finished, rng.randint(1, 9), rng.randint(0, 9), metrics)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_payload_equals_the_framed_chunks(chat, include_usage):
    rng = random.Random(hash((chat, include_usage)) % 1000)
    fast = ChunkMaker("cmpl-x", 'm"odel/é', chat, include_usage)
    slow = ChunkMaker("cmpl-x", 'm"odel/é', chat, include_usage)
    slow.base = fast.base  # the same `created`
    for i in range(300):
        out = random_output(rng, finished=i % 50 == 49, logprobs=i % 7 == 3)
        got, want = fast.payload(out), plain(slow, out)
        assert got == want
        for event in filter(None, got.split(b"\n\n")):
            assert event.startswith(b"data: ")
            json.loads(event[len(b"data: "):])
    assert fast.offsets == slow.offsets  # text offsets for later logprobs agree


def test_nothing_new_sends_nothing():
    maker = ChunkMaker("cmpl-x", "course", False, True)
    assert maker.payload(StreamOutput("r", [], False, 3, 0)) == b""
