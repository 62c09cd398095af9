"""Layer 6 over HTTP with the official `openai` client and raw bytes (course model, CPU)."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

import layer6_serving as l6

from .helpers import PROMPTS, greedy_texts_match_offline, sse_events

MSG = [{"role": "user", "content": "Who art thou?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def aclient(server):
    return lambda: openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                      max_retries=0, timeout=60)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["course"]


def test_greedy_text_equals_the_offline_engine(client, offline):
    greedy_texts_match_offline(client, offline)


def test_chat_uses_the_models_template_and_reports_usage(client, server, offline):
    r = client.chat.completions.create(model="course", messages=MSG, max_tokens=30, temperature=0)
    ids = server.engines["course"].encode_chat(MSG)
    sp = l6.parallel.SamplingParams(temperature=0, max_tokens=30, stop=("\n\n",))
    assert r.choices[0].message.content == offline.generate([ids], sp)[0].outputs[0].text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    extra = r.model_extra["llm_stack"]
    assert extra["ttft_s"] > 0 and extra["cached_prompt_tokens"] >= 0


def test_chat_stream_with_usage(client):
    chunks = list(client.chat.completions.create(
        model="course", messages=MSG, max_completion_tokens=12, stream=True,
        stream_options={"include_usage": True}, temperature=0))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert chunks[-1].model_extra["llm_stack"]["ttft_s"] > 0
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] in ("stop", "length")


def test_async_client_stream_and_not(aclient):
    async def go():
        async with aclient() as c:
            whole = await c.completions.create(model="course", prompt=PROMPTS[0], max_tokens=10,
                                               temperature=0)
            parts = [ch.choices[0].text async for ch in await c.completions.create(
                model="course", prompt=PROMPTS[0], max_tokens=10, temperature=0, stream=True)]
            return whole.choices[0].text, "".join(parts)
    whole, streamed = asyncio.run(go())
    assert whole == streamed and whole


def test_sse_framing_usage_chunk_and_done(server):
    body = {"model": "course", "prompt": PROMPTS[0], "max_tokens": 5, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.content)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(c["object"] == "text_completion" for c in chunks)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    assert usage["usage"]["prompt_tokens"] == 3 and "llm_stack" in usage
    assert all(c["usage"] is None for c in chunks[:-1])
    finishes = [ch["finish_reason"] for c in chunks[:-1] for ch in c["choices"]]
    assert finishes.count("length") == 2  # one per completion, n=2


def test_seed_reproduces_and_n_gives_distinct_samples(client):
    def sample(seed):
        r = client.completions.create(model="course", prompt=PROMPTS[0], max_tokens=16, n=3,
                                      temperature=1.0, seed=seed)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    a, b = sample(7), sample(7)
    assert a == b and len(set(a)) > 1


def test_logprobs_completions_and_chat(client):
    r = client.completions.create(model="course", prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) == 2 and max(t.values()) == pytest.approx(v, abs=1e-5)
               for t, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))  # greedy = top
    c = client.chat.completions.create(model="course", messages=MSG, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 3 for t in content)


def test_frequency_penalty_changes_a_repetitive_greedy_output(client):
    kw = dict(model="course", prompt=PROMPTS[0], max_tokens=40, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    penalized = client.completions.create(frequency_penalty=2.0, **kw).choices[0].text
    words = plain.split()
    assert len(set(words)) < len(words)  # the model repeats itself here
    assert penalized != plain
    assert len(set(penalized.split())) / len(penalized.split()) > len(set(words)) / len(words)


def test_stop_string_split_across_tokens_never_leaks(client):
    kw = dict(model="course", prompt=PROMPTS[0], max_tokens=30, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = full[5:12]  # spans several tokens
    assert len(stop) == 7
    want = full[:full.index(stop)]
    for stream in (False, True):
        r = client.completions.create(stop=[stop, "zzz"], stream=stream, **kw)
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == want
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_64_concurrent_streaming_clients_all_complete(aclient):
    async def one(c, i):
        n, finish = 0, None
        async for ch in await c.completions.create(model="course", prompt=PROMPTS[i % 3],
                                                   max_tokens=8, temperature=0.7, seed=i,
                                                   stream=True):
            n += len(ch.choices[0].text) > 0
            finish = ch.choices[0].finish_reason or finish
        return finish

    async def go():
        async with aclient() as c:
            return await asyncio.gather(*[one(c, i) for i in range(64)])
    finishes = asyncio.run(go())
    assert len(finishes) == 64 and all(f in ("stop", "length") for f in finishes)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    m = re.search(rf'^llm_stack:{name}\{{model_name="course"\}} (\S+)$', text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_16_disconnects_leave_nothing_behind(server, client):
    body = {"model": "course", "prompt": PROMPTS[2], "max_tokens": 200, "stream": True,
            "ignore_eos": True}

    async def leave(c):
        async with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return  # closing the response drops the connection mid-stream

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            await asyncio.gather(*[leave(c) for _ in range(16)])
        engine = server.engines["course"]
        for _ in range(1000):  # bounded: 10 s
            if engine.snapshot.requests == 0:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
    asyncio.run(go())
    snap = server.engines["course"].snapshot
    assert snap.requests == 0 and snap.running == 0 and snap.kv_blocks_used == 0
    assert metric(server, "num_requests_running") == 0
    assert metric(server, "kv_cache_blocks_used") == 0
    r = client.completions.create(model="course", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def test_error_mid_stream_is_an_error_event_then_done(server, monkeypatch):
    llm = server.engines["course"].llm
    real, calls = llm.step, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return real(*a, **k)
    monkeypatch.setattr(llm, "step", flaky)
    body = {"model": "course", "prompt": PROMPTS[0], "max_tokens": 20, "stream": True,
            "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    events = sse_events(r.content)
    assert r.status_code == 200 and events[-1] == b"[DONE]"
    err = json.loads(events[-2])["error"]
    assert "injected fault" in err["message"] and set(err) == {"message", "type", "param", "code"}
    assert json.loads(events[0])["choices"][0]["text"] is not None  # tokens came first


def test_a_repeated_prompt_reports_cached_prompt_tokens(client, server):
    prompt = "KING.\n" + "Now is the winter of our discontent made glorious summer. " * 3
    kw = dict(model="course", prompt=prompt, max_tokens=2, temperature=0)
    client.completions.create(**kw)
    again = client.completions.create(**kw)
    cached = again.model_extra["llm_stack"]["cached_prompt_tokens"]
    assert cached >= 16 and cached < again.usage.prompt_tokens  # whole blocks of 16 tokens
    assert metric(server, "prefix_cache_hit_rate") > 0


def test_a_batch_of_prompts_gives_choices_prompt_major(client, server, offline):
    sp = l6.parallel.SamplingParams(temperature=0, max_tokens=8)
    want = [o.outputs[0].text for o in offline.generate(PROMPTS[:2], sp)]
    ids = [server.engines["course"].encode(p) for p in PROMPTS[:2]]
    for prompt in (PROMPTS[:2], ids):  # a list of strings, a list of token-id lists
        r = client.completions.create(model="course", prompt=prompt, max_tokens=8, n=2,
                                      temperature=0)
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        assert [c.text for c in r.choices] == [want[0], want[0], want[1], want[1]]
        assert r.usage.prompt_tokens == sum(map(len, ids))
        assert r.usage.completion_tokens == 4 * 8


def test_a_streamed_batch_of_prompts(client, offline):
    sp = l6.parallel.SamplingParams(temperature=0, max_tokens=8)
    want = [o.outputs[0].text for o in offline.generate(PROMPTS, sp)]
    chunks = list(client.completions.create(model="course", prompt=PROMPTS, max_tokens=8,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts, finishes = {}, {}
    for c in chunks[:-1]:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            finishes[ch.index] = ch.finish_reason or finishes.get(ch.index)
    assert [texts[i] for i in range(3)] == want
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
