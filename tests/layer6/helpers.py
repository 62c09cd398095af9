"""Helpers the layer-6 tests share: waiting for an idle engine, OpenAI-style error bodies,
and the greedy-equals-offline check every server mode must pass."""
from __future__ import annotations

import asyncio

import httpx

import layer6_serving as l6

ERROR_FIELDS = {"message", "type", "param", "code"}
PROMPTS = ["ROMEO.\n", "JULIET.\nO Romeo, Romeo!\n\nROMEO.\n", "HAMLET.\nTo be, or not to be"]


async def wait_idle(engine, limit_s: float = 10.0) -> None:
    """Wait (bounded) until the engine tracks no request."""
    for _ in range(int(limit_s / 0.01)):
        if engine.snapshot.requests == 0 and engine.snapshot.running == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.snapshot}")


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def error_of(r) -> dict:
    """The OpenAI-style error of a response: every field there, a message said."""
    err = r.json()["error"]
    assert set(err) == ERROR_FIELDS and err["message"]
    return err


def greedy_texts_match_offline(client, offline) -> list[str]:
    """Greedy completions of PROMPTS through `client` (one by one, then streamed) equal the
    offline engine's; returns the offline texts."""
    sp = l6.parallel.SamplingParams(temperature=0, max_tokens=24)
    want = [o.outputs[0].text for o in offline.generate(PROMPTS, sp)]
    got = [client.completions.create(model="course", prompt=p, max_tokens=24, temperature=0)
           .choices[0].text for p in PROMPTS]
    assert got == want
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="course", prompt=PROMPTS[1], max_tokens=24, temperature=0, stream=True))
    assert streamed == want[1]
    return want
