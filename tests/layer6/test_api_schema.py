"""Layer 6 fuzzed from its own OpenAPI schema (schemathesis): never a 5xx, and every error
body in OpenAI's shape. Bounded: 25 examples per operation, max_tokens and n clamped."""
from __future__ import annotations

import pytest

# CI installs schemathesis; the GPU machine does not (its GPU tests skip this file cleanly).
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def _clamp(body) -> None:
    """Keep generation tiny: the fuzzer checks validation, not throughput."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool):
            body[key] = max(-1, min(body[key], 3))
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 3
    if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool):
        body["n"] = min(body["n"], 2)


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_openai_error_bodies(case, server):
    _clamp(case.body)
    r = case.call(base_url=server.url, timeout=60)
    assert r.status_code < 500, r.text[:500]
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
