"""Layer 6 errors: OpenAI's body and status for every client mistake; auth; 429; metrics."""
from __future__ import annotations

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

import layer6_serving as l6

from .helpers import error_of, post


@pytest.mark.parametrize("body,param", [
    ({"model": "course", "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": "course", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "course", "prompt": "x", "n": 0}, "n"),
    ({"model": "course", "prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"model": "course"}, "prompt"),
    ({"model": "course", "prompt": "x", "echo": True}, "echo"),
    ({"model": "course", "prompt": [[1, 2], []]}, "prompt.1"),
    ({"model": "course", "prompt": []}, "prompt"),
    ({"model": "course", "prompt": [10 ** 9]}, "prompt"),
    ({"model": "course", "prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
])
def test_bad_completion_parameters_are_400(server, body, param):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert error_of(r)["param"].startswith(param)


def test_bad_chat_parameters_are_400(server):
    for body in ({"model": "course", "messages": []},
                 {"model": "course", "messages": [{"role": "wizard", "content": "x"}]},
                 {"model": "course", "messages": [{"role": "user", "content": "x"}],
                  "top_logprobs": 2}):
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 400 and error_of(r)["type"] == "invalid_request_error"


def test_prompt_longer_than_the_context_is_400_not_500(server):
    for path, body in (("/v1/completions", {"model": "course", "prompt": "word " * 2000}),
                       ("/v1/chat/completions", {"model": "course", "messages": [
                           {"role": "user", "content": "word " * 2000}]})):
        r = post(server, path, body)
        assert r.status_code == 400 and "context" in error_of(r)["message"]


def test_invalid_json_and_unknown_routes(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and error_of(r)
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and error_of(r)


def test_unknown_model_is_404_through_the_client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_api_key_is_checked(server):
    app = l6.create_app(server.engines, api_key="sesame")
    with TestClient(app) as tc:
        assert tc.get("/v1/models").status_code == 401
        r = tc.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
        assert tc.get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
        assert tc.get("/health").status_code == 200  # probes stay open


def test_overload_is_429_with_retry_after(server, monkeypatch):
    monkeypatch.setattr(server.engines["course"], "max_waiting", 0)
    r = post(server, "/v1/completions", {"model": "course", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert error_of(r)["type"] == "rate_limit_exceeded"


def test_health_and_metrics(server):
    post(server, "/v1/completions", {"model": "course", "prompt": "ROMEO.\n", "max_tokens": 3})
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics").text
    for name in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_count", "num_requests_running",
                 "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate",
                 "prompt_tokens_total", "generation_tokens_total"):
        assert f"llm_stack:{name}" in text, name
