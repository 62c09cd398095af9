"""A fuzz suite of hostile requests against the OpenAI-compatible server (127.0.0.1, the
course model, bounded: a few hundred requests, 16 at a time, seconds of generation at most).

The classes the server was broken by once, each field in turn: lone surrogates, numeric
extremes (0, -1, 5e-324, 1e-40, 1e308, NaN, Infinity, 2**64, huge ints), wrong types,
oversized lists and strings, malformed JSON, wrong content types, unknown routes and
methods; then a random generator with a fixed seed that mutates valid bodies. Every answer
must be below 500; every 4xx must be OpenAI's error shape; a streamed 200 must not end in a
server error; and after it all the server is healthy, holds no KV blocks and still answers.
"""
from __future__ import annotations

import asyncio
import json
import random

import httpx

SHAPE = {"message", "type", "param", "code"}
NUMBERS = [0, -1, 1, 2, 3, 5e-324, 1e-40, 1e-7, 0.5, 1e308, -1e308, 2**31, 2**63, 2**64,
           10**30, -(10**30), "NaN", "Infinity", "-Infinity", True, None, "1", [], {}]
STRINGS = ["", "x\udfffy", "\ud800", "\x00", "a" * 5000, "\u202e\u2066", "💥" * 100, 7, None,
           ["a"], {"a": 1}]
NUMERIC_FIELDS = ["temperature", "top_p", "top_k", "max_tokens", "n", "seed",
                  "presence_penalty", "frequency_penalty", "logprobs", "priority", "best_of",
                  "max_completion_tokens", "top_logprobs"]
CHAT_NUMERIC = ["temperature", "top_p", "n", "max_completion_tokens", "top_logprobs"]
BASE = {"/v1/completions": {"model": "course", "prompt": "ROMEO.\n", "max_tokens": 4},
        "/v1/chat/completions": {"model": "course", "max_tokens": 4,
                                 "messages": [{"role": "user", "content": "hi"}]}}


def raw(value) -> str:
    """JSON text, with NaN / Infinity written as Python's json writes them (bare words)."""
    return json.dumps(value, allow_nan=True)


def substitute(body: dict, field: str, value) -> str:
    text = json.dumps({**body, field: "__V__"})
    v = value if value in ("NaN", "Infinity", "-Infinity") else raw(value)
    return text.replace('"__V__"', v)


def cases() -> list[tuple[str, str, str, dict]]:
    """(method, path, body text, headers): the classes above, each field in turn."""
    out = []
    js = {"content-type": "application/json"}
    for path, base in BASE.items():
        for field in NUMERIC_FIELDS if path == "/v1/completions" else CHAT_NUMERIC:
            for v in NUMBERS:
                out.append(("POST", path, substitute(base, field, v), js))
        for field in ("model", "stop", "user", "suffix"):
            for v in STRINGS:
                out.append(("POST", path, substitute(base, field, v), js))
        out += [("POST", path, substitute(base, "stop", ["s"] * n), js) for n in (17, 5000)]
        out += [("POST", path, substitute(base, "stop", ["z" * 1000] * 4), js),
                ("POST", path, substitute(base, "logit_bias", {"1": 100}), js),
                ("POST", path, substitute(base, "stream", "yes"), js),
                ("POST", path, substitute(base, "stream_options", {"include_usage": "x"}), js),
                ("POST", path, "{not json", js), ("POST", path, "", js), ("POST", path, "[]", js),
                ("POST", path, "null", js), ("POST", path, '"x"', js), ("POST", path, "1e999", js),
                ("POST", path, json.dumps(base), {"content-type": "text/plain"}),
                ("POST", path, json.dumps(base).encode("utf-16").decode("latin-1"), js),
                ("POST", path, b"\xff\xfe\xfa".decode("latin-1"), js),
                ("GET", path, "", {}), ("PUT", path, json.dumps(base), js),
                ("POST", path, "[" * 10000 + "]" * 10000, js)]
    comp = BASE["/v1/completions"]
    for v in ([], [[]], [[1, 2], []], [10**9], [-1], [2**70], [[1] * 10, "x"], ["a"] * 65,
              [[1]] * 65, {"a": 1}, 5, [None], "x\udfff", "x" * 20_000, ["ok", "\ud800"]):
        out.append(("POST", "/v1/completions", substitute(comp, "prompt", v), js))
    chat = BASE["/v1/chat/completions"]
    for v in ([], [{}], [{"role": "wizard", "content": "x"}], [{"role": "user"}],
              [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
              [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}],
              [{"role": "user", "content": "x", "name": "\ud800"}],
              [{"role": "user", "content": "hi"}] * 3000, "hi", [None],
              [{"role": "user", "content": "x" * 20_000}]):
        out.append(("POST", "/v1/chat/completions", substitute(chat, "messages", v), js))
    for v in ({"type": "json_object"}, {"type": "text"}, "x", {"type": "\udfff"}):
        out.append(("POST", "/v1/chat/completions", substitute(chat, "response_format", v), js))
    out += [("GET", "/v1/nothing", "", {}), ("DELETE", "/v1/models", "", {}),
            ("GET", "/v1/models/../../etc/passwd", "", {}), ("GET", "/%ff%fe", "", {})]
    return out


def random_cases(n: int, seed: int = 1234) -> list[tuple[str, str, str, dict]]:
    """Valid bodies with 1-3 fields replaced by random hostile values (fixed seed)."""
    rng = random.Random(seed)
    pool = NUMBERS + STRINGS + [[rng.random() for _ in range(3)], -0.0, 1.5, 0.0001]
    fields = NUMERIC_FIELDS + ["model", "stop", "prompt", "messages", "stream", "echo", "n"]
    out = []
    for _ in range(n):
        path = rng.choice(list(BASE))
        body = dict(BASE[path], stream=rng.random() < 0.3)
        text = json.dumps(body)
        for field in rng.sample(fields, rng.randint(1, 3)):
            text = substitute(json.loads(text), field, rng.choice(pool))
        out.append(("POST", path, text, {"content-type": "application/json"}))
    return out


async def _run(url: str, reqs) -> list[tuple[int, bytes, tuple]]:
    sem = asyncio.Semaphore(16)
    limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
        async def one(req):
            method, path, body, headers = req
            async with sem:
                data = body.encode("utf-8", "surrogatepass")  # lone surrogates as sent raw
                r = await c.request(method, path, content=data, headers=headers)
                return r.status_code, r.content, req
        return await asyncio.gather(*(one(r) for r in reqs))


def check(status: int, content: bytes, req) -> None:
    assert status < 500, (status, content[:300], req[:3])
    if status >= 400:
        err = json.loads(content)["error"]
        assert set(err) == SHAPE and isinstance(err["message"], str) and err["message"], \
            (status, content[:300], req[:3])
        assert err["type"] not in ("server_error",), (status, content[:300])
    elif content.startswith(b"data: "):
        for line in content.split(b"\n"):
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                assert "error" not in event or event["error"]["type"] != "server_error", event


def test_fuzz_no_5xx_every_4xx_openai_shaped_server_healthy_after(server):
    reqs = cases() + random_cases(100)
    assert len(reqs) >= 400
    results = asyncio.run(_run(server.url, reqs))
    for status, content, req in results:
        check(status, content, req)
    statuses = [s for s, _, _ in results]
    print(f"\n{len(results)} hostile requests: {statuses.count(200)} x 200, "
          f"{sum(400 <= s < 500 for s in statuses)} x 4xx, 0 x 5xx")
    assert statuses.count(200) > 20 and sum(400 <= s < 500 for s in statuses) > 200
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert health["status"] == "ok"
    assert health["models"]["course"]["kv_cache_usage"] == 0
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "course", "prompt": "ROMEO.\n", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
