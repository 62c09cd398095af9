"""Layer 6 with several models in one app: /v1/models lists them and each request runs on the
engine of the model it names (two engines over the session server's loaded model); and a
server over layer 5's tensor-parallel engine (2 CPU ranks on gloo)."""
from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

import layer6_serving as l6


def test_each_request_goes_to_the_engine_it_names(server):
    model = server.engines["course"].llm.model
    engines = {name: l6.AsyncEngine(l6.parallel.LLM(model, num_blocks=32), name=name)
               for name in ("bard", "fool")}
    try:
        with TestClient(l6.create_app(engines)) as tc:
            ids = [m["id"] for m in tc.get("/v1/models").json()["data"]]
            assert ids == ["bard", "fool"]
            r = tc.post("/v1/completions", json={"model": "fool", "prompt": "ROMEO.\n",
                                                 "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.json()["model"] == "fool"
            assert engines["fool"].snapshot.generation_tokens == 3
            assert engines["bard"].snapshot.generation_tokens == 0
            assert tc.post("/v1/completions", json={"model": "course", "prompt": "x"}
                           ).status_code == 404
    finally:
        for e in engines.values():
            e.shutdown()


@pytest.mark.slow
def test_tensor_parallel_server_gives_the_same_greedy_text(offline):
    sp = l6.parallel.SamplingParams(temperature=0, max_tokens=12)
    want = offline.generate(["ROMEO.\n"], sp)[0].outputs[0].text
    with l6.start_server(["course"], tensor_parallel_size=2, num_blocks=64,
                         dtype="float32") as srv:
        assert srv.engines["course"].llm.tensor_parallel_size == 2
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "model": "course", "prompt": "ROMEO.\n", "max_tokens": 12, "temperature": 0})
        assert r.json()["choices"][0]["text"] == want
