"""Failover and autoscaling, with real replicas: a replica killed under load loses no request
silently (each one completes or ends with a clear error) and new requests go to the others;
the autoscaler adds a replica under a load ramp and removes it when the load is gone."""
from __future__ import annotations

import threading
import time

import httpx

import layer6_serving
from layer7_app.router import Autoscaler, start_router

from .router_helpers import read_stream

# Long enough (hundreds of steps) to outlive the killed server's 2 s graceful shutdown.
STREAM = {"model": "course", "prompt": "ROMEO.\n", "max_tokens": 300, "ignore_eos": True,
          "stream": True}


def run_streams(url: str, n: int, body: dict, results: list, started: threading.Event) -> list:
    """n streaming requests at once, each in its own thread (bounded by httpx timeouts)."""
    def one(i: int) -> None:
        with httpx.Client(timeout=60) as c:
            try:
                results[i] = read_stream(c, url + "/v1/completions", dict(body, seed=i))
            except httpx.HTTPError as e:  # the router itself must never do this
                results[i] = {"status": None, "error": f"client: {e!r}", "done": False}
        started.set()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_killing_a_replica_under_load_loses_no_request_silently(model_server):
    victim = layer6_serving.start_server(("course",))
    with start_router([model_server.url, victim.url], policy="round_robin",
                      health_interval=0.2) as router:
        results: list = [None] * 8
        threads = run_streams(router.url, 8, STREAM, results, threading.Event())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until the victim is streaming
            reps = httpx.get(router.url + "/router/replicas", timeout=10).json()["replicas"]
            if next(r for r in reps if r["url"] == victim.url)["in_flight"] >= 2:
                break
            time.sleep(0.05)
        victim.stop()
        for t in threads:
            t.join(90)
        assert all(not t.is_alive() for t in threads), "a request hung"
        for i, r in enumerate(results):
            completed = r["status"] == 200 and r["done"] and r["finish"] == "length" \
                and not r["error"]
            failed_clearly = bool(r["error"]) and (r["status"] != 200 or r["done"])
            assert completed != failed_clearly, f"request {i} ended unclearly: {r}"
        assert any(r["error"] for r in results), "the victim's requests should have failed"
        assert any(not r["error"] for r in results)
        with httpx.Client(timeout=60) as c:  # new requests go to the living replica
            for i in range(3):
                r = c.post(router.url + "/v1/completions",
                           json={"model": "course", "prompt": f"ROMEO.\n{i}", "max_tokens": 2})
                assert r.status_code == 200, r.text
            health = c.get(router.url + "/health").json()
        dead = next(r for r in health["replicas"] if r["url"] == victim.url)
        assert not dead["healthy"]


def test_autoscaler_adds_a_replica_under_a_load_ramp_and_removes_it_after():
    scaler = Autoscaler("course", min_replicas=1, max_replicas=2, up_at=1.5, down_at=0.5,
                        interval=0.2, cooldown=1.0)
    with start_router([], autoscaler=scaler, policy="least_loaded") as router:
        with httpx.Client(timeout=60) as c:  # ramp, step 1: one request at a time
            for i in range(3):
                r = c.post(router.url + "/v1/completions",
                           json={"model": "course", "prompt": f"ROMEO.\n{i}", "max_tokens": 4})
                assert r.status_code == 200, r.text
        assert [e["action"] for e in scaler.events] == ["start"]
        results: list = [None] * 6  # step 2: six streams at once
        threads = run_streams(router.url, 6, dict(STREAM, max_tokens=100), results,
                              threading.Event())
        deadline = time.monotonic() + 60
        while "up" not in [e["action"] for e in scaler.events] and time.monotonic() < deadline:
            time.sleep(0.1)
        for t in threads:
            t.join(90)
        assert all(r and r["done"] and not r["error"] for r in results), results
        deadline = time.monotonic() + 60  # its own: the ramp's streams may have used the first
        while "down" not in [e["action"] for e in scaler.events] and time.monotonic() < deadline:
            time.sleep(0.1)  # step 3: no load
        actions = [e["action"] for e in scaler.events]
        assert actions == ["start", "up", "down"], scaler.events
        assert scaler.events[1]["load"] > 1.5 and scaler.events[1]["replicas"] == 2
        assert len(router.replicas.replicas) == 1
