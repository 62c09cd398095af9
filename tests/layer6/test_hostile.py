"""Input one client sends cannot hurt the server or the other clients: lone surrogates are a
400 naming the field (the model too), bodies over the limit a 413 before they are read, stop
lists and strings are bounded, text too long for any context is refused before it is
tokenized, a 4xx keeps the keep-alive connection, and a hostile request in the middle of 16
streams leaves all 16 exactly as they are without it."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from .helpers import error_of, post

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"model": "course", "prompt": "x\udfffy"}, "prompt"),
    ("/v1/completions", {"model": "course", "prompt": ["ok", "x\ud800"]}, "prompt.1"),
    ("/v1/completions", {"model": "\ud800", "prompt": "x"}, "model"),
    ("/v1/completions", {"model": "course", "prompt": "x", "stop": ["\udc00"]}, "stop.0"),
    ("/v1/completions", {"model": "course", "prompt": "x", "user": "\udc00"}, "user"),
    ("/v1/chat/completions", {"model": "\udfff", "messages": MSG}, "model"),
    ("/v1/chat/completions", {"model": "course", "messages": [
        {"role": "user", "content": "a\ud800"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"model": "course", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"model": "course", "messages": [
        {"role": "user", "content": "x", "name": "\ud800"}]}, "messages.0.name"),
])
def test_lone_surrogates_are_400_naming_the_field(server, path, body, param):
    # json.dumps escapes them as \\udfff, as a hostile client would send them
    r = httpx.post(server.url + path, content=json.dumps(body),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param


def test_bounds_on_stop_and_lists(server):
    for body, param in (({"stop": ["s"] * 17}, "stop"), ({"stop": ["x" * 300]}, "stop.0"),
                        ({"stop": "x" * 300}, "stop"), ({"priority": 2**40}, "priority"),
                        ({"prompt": ["a"] * 65}, "prompt")):
        r = post(server, "/v1/completions", {"model": "course", "prompt": "x", **body})
        assert r.status_code == 400 and error_of(r)["param"] == param, (body, r.text)


def test_text_too_long_for_any_context_is_refused_before_tokenizing(server):
    engine = server.engines["course"]
    calls = []
    real = engine.tokenizer.tok.encode
    big = "w" * (engine.max_prompt_chars + 1)
    try:
        engine.tokenizer.tok.encode = lambda *a, **k: calls.append(1) or real(*a, **k)
        for path, body in (("/v1/completions", {"prompt": big}),
                           ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                    "content": big}]})):
            r = post(server, path, {"model": "course", **body})
            assert r.status_code == 400 and "characters" in error_of(r)["message"], r.text
    finally:
        engine.tokenizer.tok.encode = real
    assert not calls


def test_body_limit_413_from_the_header_and_while_reading(server):
    big = b'{"model": "course", "prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}'
    r = httpx.post(server.url + "/v1/completions", content=big,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and error_of(r)["code"] == "body_too_large"

    def chunks():  # no Content-Length: the server counts as it reads
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)]
    r = httpx.post(server.url + "/v1/completions", content=chunks(),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and error_of(r)["code"] == "body_too_large"
    assert httpx.get(server.url + "/health").status_code == 200


def _raw(sock: socket.socket, body: bytes) -> bytes:
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    n = int([ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0]
            .split(b":")[1])
    while len(rest) < n:
        rest += sock.recv(65536)
    return head.split(b"\r\n")[0]


def test_keep_alive_survives_a_4xx(server):
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        assert b" 400 " in _raw(s, json.dumps({"model": "course", "prompt": "x\udfffy"}).encode())
        assert b" 404 " in _raw(s, b'{"model": "nope", "prompt": "x"}')
        assert b" 200 " in _raw(s, b'{"model": "course", "prompt": "x", "max_tokens": 2}')


def test_vanishing_temperature_is_greedy_over_http(server):
    base = {"model": "course", "prompt": "ROMEO.\n", "max_tokens": 8}
    ref = post(server, "/v1/completions", {**base, "temperature": 0}).json()
    for extra in ({"temperature": 1e-40}, {"temperature": 5e-324}, {"top_p": 5e-324},
                  {"temperature": 1e-300, "top_p": 1e-300}):
        r = post(server, "/v1/completions", {**base, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"], extra
    for extra in ({"temperature": float("nan")}, {"top_p": float("inf")},
                  {"presence_penalty": float("-inf")}):
        r = httpx.post(server.url + "/v1/completions", content=json.dumps({**base, **extra}),
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, (extra, r.text)


async def _stream(client, body) -> tuple[str, int]:
    text, tokens = "", 0
    async with client.stream("POST", "/v1/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
    return text, tokens


HOSTILE = [{"temperature": 1e-40}, {"top_p": 5e-324}, {"prompt": "x\udfffy"},
           {"stop": ["z" * 1000] * 4000}, {"temperature": 5e-324, "stream": True}]


def _parts_at_a_near_tie(offline, prompt: str, a: str, b: str) -> bool:
    """Whether two greedy continuations a != b of `prompt` part where greedy's two best tokens
    are within rounding of each other, as the offline engine sees the prompt alone: a CPU
    GEMM rounds a row differently with the rows around it, so a near-tie may go either way
    with the batch's composition; anything else that makes them part is a real difference.
    Within rounding: 16 units of the model's dtype at 1.0 (bf16: 0.125, a few units at the
    logits' magnitude ~10; fp32: 2e-6)."""
    import torch

    import layer6_serving as l6

    dtype = next(offline.model.net.parameters()).dtype

    sp = l6.parallel.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    out = offline.generate([prompt], sp)[0].outputs[0]
    tok = offline.model.tokenizer
    part = next(i for i, (x, y) in enumerate(zip(a + "\0", b + "\1", strict=False)) if x != y)
    for k in range(len(out.token_ids)):
        text = tok.decode(out.token_ids[:k + 1])
        if len(text) > part:  # token k holds the first character where a and b part
            (_, best), (_, second) = out.logprobs[k].top[:2]
            return text[:part] == a[:part] and best - second <= 16 * torch.finfo(dtype).eps
    return False


def test_hostile_requests_amid_16_streams(server, offline):
    # greedy: the same tokens whatever else shares the batch (seeded sampling would draw
    # from probabilities that differ in the last bits with the batch's composition), but for
    # a near-tie of the two best tokens, which a CPU GEMM may round either way with the
    # rows around it: a stream that parts from its reference must part at one
    bodies = [{"model": "course", "prompt": f"ROMEO {i}.\n", "max_tokens": 24,
               "temperature": 0, "ignore_eos": True} for i in range(16)]

    async def main(hostile: bool):
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            tasks = [asyncio.ensure_future(_stream(c, b)) for b in bodies]
            statuses = []
            if hostile:
                await asyncio.sleep(0.2)  # the streams are running
                for h in HOSTILE:
                    r = await c.post("/v1/completions", content=json.dumps(
                        {"model": "course", "prompt": "a", "max_tokens": 4, **h}),
                        headers={"content-type": "application/json"})
                    statuses.append(r.status_code)
            return await asyncio.gather(*tasks), statuses

    ref, _ = asyncio.run(main(False))
    t0 = time.perf_counter()
    got, statuses = asyncio.run(main(True))
    assert all(s < 500 for s in statuses), statuses
    assert all(n == 24 for _, n in got)
    for body, (text, _), (want, _) in zip(bodies, got, ref, strict=True):
        assert text == want or _parts_at_a_near_tie(offline, body["prompt"], text, want), \
            (body["prompt"], text, want)
    assert time.perf_counter() - t0 < 60


def test_with_an_api_key_strangers_learn_nothing(server):
    from fastapi.testclient import TestClient

    import layer6_serving as l6

    key = {"Authorization": "Bearer sesame"}
    with TestClient(l6.create_app(server.engines, api_key="sesame")) as tc:
        health = tc.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert "course" in tc.get("/health", headers=key).json()["models"]
        assert tc.get("/metrics").status_code == 401
        assert "llm_stack:" in tc.get("/metrics", headers=key).text
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert tc.get(path).status_code == 404, path
        assert tc.get("/v1/models").status_code == 401
    with TestClient(l6.create_app(server.engines, api_key="sesame", open_metrics=True,
                                  docs=True)) as tc:
        assert tc.get("/metrics").status_code == 200  # for a Prometheus without the key
        assert tc.get("/openapi.json").status_code == 200


def test_the_openapi_schema_documents_the_statuses_it_answers(server):
    schema = httpx.get(server.url + "/openapi.json").json()  # no key: docs on
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses
        assert {"400", "404", "413", "429", "503"} <= set(responses), responses
    assert "HTTPValidationError" not in json.dumps(schema)


def test_a_request_whose_sampling_goes_bad_ends_alone(server):
    """Past validation, a row whose probabilities go nan (here: a temperature slipped in
    after admission) ends its own request with a sampling_error; the 16 streams beside it
    in the same steps finish untouched (layer 4's sampling guard, layer 6's SamplingError)."""
    import layer6_serving as l6
    from layer6_serving.api.errors import from_exception

    engine = server.engines["course"]
    sp = l6.parallel.SamplingParams

    async def main():
        others = [await engine.generate(f"ROMEO {i}.\n", sp(temperature=0, max_tokens=24,
                                                              ignore_eos=True))
                  for i in range(16)]
        # long enough that it is still running when the poll below finds it, however busy
        # the machine (the poll and the engine share it)
        bad = await engine.generate("a", sp(temperature=0.5, max_tokens=400, ignore_eos=True))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # once the engine holds it, its numbers go bad
            held = engine.llm._requests.get(bad.request_id)
            if held:
                held[1][0].params = sp(temperature=1e-40, max_tokens=400, ignore_eos=True)
                break
            await asyncio.sleep(0.002)
        assert held, "the engine never held the request"
        results = await asyncio.gather(bad.collect(), *(s.collect() for s in others),
                                       return_exceptions=True)
        return results[0], results[1:]

    err, outs = asyncio.run(main())
    assert isinstance(err, l6.EngineStepError) and "sampling failed" in str(err)
    assert from_exception(err).code == "sampling_error"
    assert all(not isinstance(o, BaseException) for o in outs), outs
    assert all(len(o.deltas[0].token_ids) == 24 for o in outs)
