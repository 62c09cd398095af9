"""Helpers the layer-6 tests share: waiting for an idle engine, OpenAI-style error bodies and
SSE framing, JSON-schema replies checked against their schemas, and the greedy-equals-offline
check every server mode must pass."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai

import layer6_serving as l6

ERROR_FIELDS = {"message", "type", "param", "code"}
PROMPTS = ["ROMEO.\n", "JULIET.\nO Romeo, Romeo!\n\nROMEO.\n", "HAMLET.\nTo be, or not to be"]


async def wait_idle(engine, limit_s: float = 30.0) -> None:
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


def sse_events(raw: bytes) -> list[bytes]:
    """Split an SSE body into event payloads, checking OpenAI's framing on the way."""
    assert raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events), raw[:300]
    return [e[len(b"data: "):] for e in events]


def validate(instance, schema: dict) -> None:
    """jsonschema.validate, imported here: its import takes ~3 s (rfc3987_syntax builds a
    grammar), paid by the worker that runs a schema test, not by every one collecting."""
    import jsonschema

    jsonschema.validate(instance, schema)


def assert_json_schemas_hold(url: str, model: str, messages: list[dict], schemas: list[dict],
                             temperature: float) -> None:
    """Every schema as a strict response_format, all requests at once (the engine batches
    their masks): each reply ends by itself ("stop") with JSON that the schema validates."""
    async def one(c: openai.AsyncOpenAI, i: int, schema: dict):
        r = await c.chat.completions.create(
            model=model, messages=messages, max_tokens=96, temperature=temperature, seed=i,
            response_format={"type": "json_schema", "json_schema": {
                "name": f"s{i}", "schema": schema, "strict": True}})
        return r.choices[0]

    async def everything():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused",
                                      max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(one(c, i, s) for i, s in enumerate(schemas)))

    for schema, ch in zip(schemas, asyncio.run(everything()), strict=True):
        assert ch.finish_reason == "stop", (schema, ch.message.content)
        validate(json.loads(ch.message.content), schema)


def assert_streamed_json_schema_holds(client: openai.OpenAI, model: str, messages: list[dict],
                                      schema: dict) -> None:
    """The schema as a strict response_format, streamed: the joined deltas are JSON that it
    validates."""
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=96, seed=5, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "u", "schema": schema,
                                                                "strict": True}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    validate(json.loads(text), schema)


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
