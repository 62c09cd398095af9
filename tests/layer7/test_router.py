"""The router in front of two real course-model replicas: what each policy does over HTTP,
streaming equal to a direct stream, a client leaving frees the replica, clear errors."""
from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

import layer6_serving
from layer7_app.router import start_router

from .conftest import engine_gauges
from .router_helpers import chat_body, read_stream

# A stream that runs for hundreds of steps unless its client leaves (no stop string, no EOS).
LONG = {"model": "course", "prompt": "ROMEO.\n", "max_tokens": 400, "ignore_eos": True,
        "stream": True}


@pytest.fixture(scope="module")
def replicas(model_server) -> Iterator[list[str]]:
    """Two replicas: the session's model server and one more."""
    with layer6_serving.start_server(("course",)) as second:
        yield [model_server.url, second.url]


@pytest.fixture()
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as c:
        yield c


def served(client: httpx.Client, router_url: str) -> dict[str, int]:
    reps = client.get(router_url + "/router/replicas").json()["replicas"]
    return {r["url"]: r["served"] for r in reps}


def running(client: httpx.Client, url: str) -> int:
    return client.get(url + "/health").json()["models"]["course"]["running"]


def test_stream_through_the_router_equals_the_direct_stream(replicas, client):
    body = chat_body([{"role": "user", "content": "What news from Verona?"}], max_tokens=20)
    direct = read_stream(client, replicas[0] + "/v1/chat/completions", body)
    with start_router(replicas[:1]) as router:
        via = read_stream(client, router.url + "/v1/chat/completions", body)
        plain = client.post(router.url + "/v1/chat/completions",
                            json=dict(body, stream=False)).json()
    assert direct["done"] and via["done"] and via["error"] is None
    assert via["text"] == direct["text"] and via["finish"] == direct["finish"]
    assert plain["choices"][0]["message"]["content"] == direct["text"]


def test_round_robin_alternates(replicas, client):
    with start_router(replicas, policy="round_robin") as router:
        for i in range(4):
            r = client.post(router.url + "/v1/completions", json={
                "model": "course", "prompt": f"ROMEO.\nLine {i}", "max_tokens": 2})
            assert r.status_code == 200, r.text
        assert sorted(served(client, router.url).values()) == [2, 2]


def test_prefix_aware_keeps_a_conversation_on_one_replica_and_hits_its_cache(replicas, client):
    with start_router(replicas, policy="prefix_aware") as router:
        msgs = [{"role": "system", "content": "Thou art a player. " * 12},
                {"role": "user", "content": "Speak of Verona."}]
        cached = []
        for turn in range(3):
            body = chat_body(msgs, max_tokens=8, stream=False)
            out = client.post(router.url + "/v1/chat/completions", json=body).json()
            cached.append(out["llm_stack"]["cached_prompt_tokens"])
            msgs += [{"role": "assistant", "content": out["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"And then, turn {turn}?"}]
        counts = served(client, router.url)
    assert sorted(counts.values()) == [0, 3], counts
    assert cached[1] > 0 and cached[2] > cached[1], cached  # later turns reuse the prefix


def test_least_loaded_avoids_the_busy_replica(replicas, client):
    with start_router(replicas, policy="least_loaded") as router:
        with client.stream("POST", router.url + "/v1/completions", json=LONG) as resp:
            lines = resp.iter_lines()  # kept: dropping it would close the stream
            next(lines)  # in flight on one replica now
            reps = client.get(router.url + "/router/replicas").json()["replicas"]
            busy = [r["url"] for r in reps if r["in_flight"] == 1]
            assert len(busy) == 1, reps
            busy = busy[0]
            for i in range(3):
                client.post(router.url + "/v1/completions", json={
                    "model": "course", "prompt": f"ROMEO.\n{i}", "max_tokens": 2})
            counts = served(client, router.url)
        idle = next(u for u in replicas if u != busy)
        assert counts[idle] == 3 and counts[busy] == 0, counts


def test_a_client_that_leaves_frees_the_replica(replicas, client):
    with start_router(replicas[1:]) as router:
        with client.stream("POST", router.url + "/v1/completions", json=LONG) as resp:
            lines = resp.iter_lines()
            for _ in range(3):
                next(lines)
            assert running(client, replicas[1]) == 1
        deadline = time.monotonic() + 10
        while running(client, replicas[1]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running(client, replicas[1]) == 0
        assert engine_gauges(replicas[1])["kv_blocks"] == 0  # its KV blocks are back
        assert client.get(router.url + "/router/replicas").json()["replicas"][0]["in_flight"] == 0


def test_a_plain_request_whose_client_leaves_is_aborted_too(replicas, client):
    with start_router(replicas[1:]) as router:
        body = dict(LONG, stream=False)
        client.post(replicas[1] + "/v1/completions",  # so that its gauges exist
                    json={"model": "course", "prompt": "ROMEO.\n", "max_tokens": 2})
        before = engine_gauges(replicas[1])["generated"]
        with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s of silence
            httpx.post(router.url + "/v1/completions", json=body, timeout=httpx.Timeout(
                5, read=1.0))
        deadline = time.monotonic() + 10
        while running(client, replicas[1]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running(client, replicas[1]) == 0
        after = engine_gauges(replicas[1])
        assert after["kv_blocks"] == 0
        assert after["generated"] - before < LONG["max_tokens"], "it ran to the end: not aborted"


def test_bad_input_and_no_replica_are_clear_errors(replicas, client):
    with start_router(replicas[:1]) as router:
        r = client.post(router.url + "/v1/completions", content=b"{not json")
        assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
        r = client.post(router.url + "/v1/completions", json=["a"])
        assert r.status_code == 400
        r = client.post(router.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert client.get(router.url + "/v1/models").json()["data"][0]["id"] == "course"
        assert client.get(router.url + "/v1/nothing").status_code == 404
    with start_router(["http://127.0.0.1:9"]) as router:  # nothing listens there
        r = client.post(router.url + "/v1/completions", json={"model": "course", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"
        assert client.get(router.url + "/health").status_code == 503
