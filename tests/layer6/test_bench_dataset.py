"""The load generator's workloads (bench_dataset.py) and its stream parsing (loadgen.py)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

import layer6_serving as l6
from layer6_serving.bench.dataset import (
    BenchRequest,
    as_request,
    chat_dataset,
    load_corpus,
    random_dataset,
)
from layer6_serving.bench.loadgen import one_request, run_load, summarize


@pytest.fixture(scope="module")
def tokenizer():
    x = l6.parallel.engine.executor
    return x.load(x.course_model_dir("target")).tokenizer


def test_corpus_is_the_held_out_plays_as_speeches():
    plays = load_corpus()
    assert len(plays) == 3 and all(len(p) > 500 for p in plays)
    speaker, text = plays[0][0]
    assert speaker == speaker.upper() and text and "\n\n" not in text


def test_chat_dataset_renders_conversations_within_the_budget(tokenizer):
    reqs = chat_dataset(60, tokenizer, max_input_len=97, max_output_len=33, seed=3)
    assert len(reqs) == 60
    assert reqs == chat_dataset(60, tokenizer, max_input_len=97, max_output_len=33, seed=3)
    turns = set()
    for r in reqs:
        assert r.endpoint == "/v1/chat/completions" and r.ignore_eos
        assert r.prompt_ids == tokenizer.encode_chat(r.messages)  # what the server sees
        assert len(r.prompt_ids) <= 97 and 4 <= r.max_tokens <= 33
        roles = [m["role"] for m in r.messages]
        assert roles[-1] == "user"
        assert all(a != b for a, b in zip(roles, roles[1:], strict=False))  # alternating
        turns.add(len(roles))
    assert len(turns) >= 3  # multi-turn-ish: varied
    assert len({len(r.prompt_ids) for r in reqs}) > 20 and len({r.max_tokens for r in reqs}) > 5


def test_chat_dataset_needs_a_chat_template():
    with pytest.raises(ValueError, match="chat template"):
        chat_dataset(4, object())


def test_random_dataset_as_text_reencodes_to_its_ids(tokenizer):
    reqs = random_dataset(7, 23, 5, 4096, tokenizer=tokenizer, seed=1)
    for r in reqs:
        assert isinstance(r.prompt, str) and r.ignore_eos and r.endpoint == "/v1/completions"
        assert tokenizer.encode(r.prompt, add_special_tokens=False) == r.prompt_ids
        assert 2 <= r.max_tokens <= 7
    ids_only = random_dataset(5, 11, 3, 97, seed=2)
    assert all(r.prompt is None and 5 <= len(r.prompt_ids) <= 16 and
               all(10 <= t < 97 for t in r.prompt_ids) for r in ids_only)
    with pytest.raises(ValueError, match=">= 1"):
        random_dataset(0, 8, 8, 100)


def test_request_bodies():
    chat = BenchRequest(prompt_ids=[1, 2], max_tokens=9, messages=[{"role": "user",
                                                                  "content": "hi"}])
    b = chat.body("m")
    assert b["messages"][0]["content"] == "hi" and "prompt" not in b and "ignore_eos" not in b
    assert b["stream"] and b["temperature"] == 0 and b["stream_options"]["include_usage"]
    done = as_request(([5, 6, 7], 3))  # the older (ids, max_tokens) pair
    assert done.body("m")["prompt"] == [5, 6, 7] and done.body("m")["ignore_eos"]
    # transformers serve refuses unknown fields: EOS is ignored through a generation_config
    peer = done.body("m", "transformers")
    assert "ignore_eos" not in peer and "stream_options" not in peer
    assert json.loads(peer["generation_config"]) == {"do_sample": False}
    with pytest.raises(ValueError, match="dialect"):
        done.body("m", "sglang")


def _sse(chunks: list[dict], done: bool) -> bytes:
    out = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return out + (b"data: [DONE]\n\n" if done else b"")


def test_chat_stream_without_usage_or_done_counts_text_chunks():
    """transformers serve's shape: role chunk, content deltas, no [DONE]."""
    chunks = [{"choices": [{"delta": {"role": "assistant"}}]}] + [
        {"choices": [{"delta": {"content": w}}]} for w in ("To", " be", "", " or")]
    transport = httpx.MockTransport(lambda req: httpx.Response(200, content=_sse(chunks, False)))
    req = BenchRequest(prompt_ids=[1, 2, 3], max_tokens=3, messages=[{"role": "user",
                                                                     "content": "x"}])

    async def go():
        async with httpx.AsyncClient(transport=transport) as c:
            return await one_request(c, "http://peer", "m", req)
    res = asyncio.run(go())
    assert res.ok and res.output_tokens == 3 and res.prompt_tokens == 3
    assert len(res.itls) == 2 and 0 < res.ttft <= res.e2e


def test_error_event_and_http_errors_fail_the_request():
    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path.endswith("/chat/completions"):
            return httpx.Response(429, json={"error": {"message": "busy"}})
        return httpx.Response(200, content=_sse([{"error": {"message": "boom"}}], True))

    async def go(r):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            return await one_request(c, "http://s", "m", r)
    bad = asyncio.run(go(as_request(([1], 2))))
    assert not bad.ok and bad.error == "boom"
    busy = asyncio.run(go(BenchRequest([1], 2, messages=[{"role": "user", "content": "x"}])))
    assert not busy.ok and busy.error.startswith("HTTP 429")


def test_chat_workload_through_a_server_gets_exact_lengths(tokenizer):
    """Served by its directory (as the bench does): no chat stop string, EOS ignored, so each
    reply is exactly max_tokens long."""
    path = l6.parallel.engine.executor.course_model_dir("target")
    reqs = chat_dataset(6, tokenizer, max_input_len=64, max_output_len=9, seed=5)
    with l6.start_server({"c": {"model": path}}, num_blocks=64, max_num_seqs=4) as srv:
        results, dt = asyncio.run(run_load(srv.url, "c", reqs, max_concurrency=3))
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.output_tokens for r in results] == [r.max_tokens for r in reqs]
    assert [r.prompt_tokens for r in results] == [len(r.prompt_ids) for r in reqs]
    report = summarize(results, dt)
    assert report["completed"] == 6 and report["failed"] == 0
