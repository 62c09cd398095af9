"""Layer 6 with each engine in its own process (what `stack serve` runs): one server for the
module, two models (two engine processes). Greedy text, a batch of prompts, 64 streams,
disconnects freeing everything, 429, timeouts, an error mid-stream, a crashed engine (clean
errors, /health 503, no hang), and no engine process outliving its server."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

import layer6_serving as l6

from .helpers import PROMPTS, greedy_texts_match_offline, wait_idle


@pytest.fixture(scope="module")
def psrv():
    models = {"course": {"model": "course"}, "bard": {"model": "course", "num_blocks": 32}}
    with l6.start_server(models, num_blocks=256, max_num_seqs=64, engine_process=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(psrv):
    return openai.OpenAI(base_url=psrv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(srv, body, path="/v1/completions"):
    return httpx.post(srv.url + path, json=body, timeout=60)


def events(r) -> list[bytes]:
    assert r.content.endswith(b"\n\n")
    return [e[len(b"data: "):] for e in r.content[:-2].split(b"\n\n")]


def test_engines_run_in_processes_of_their_own(psrv):
    procs = {name: e.loop.proc for name, e in psrv.engines.items()}
    assert all(e.llm is None and e.alive for e in psrv.engines.values())
    assert len({p.pid for p in procs.values()} | {os.getpid()}) == 3
    assert psrv.engines["bard"].info.num_blocks == 32


def test_greedy_text_equals_the_offline_engine(client, offline):
    want = greedy_texts_match_offline(client, offline)
    batch = client.completions.create(model="course", prompt=PROMPTS, max_tokens=24,
                                      temperature=0)
    assert [c.text for c in batch.choices] == want


def test_each_request_goes_to_the_engine_it_names(psrv, client):
    before = {n: e.snapshot.generation_tokens for n, e in psrv.engines.items()}
    r = client.completions.create(model="bard", prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert r.model == "bard" and r.usage.completion_tokens == 3
    for _ in range(1000):  # bounded (10 s): the engine process's counts arrive with its next turn
        if psrv.engines["bard"].snapshot.generation_tokens == before["bard"] + 3:
            break
        time.sleep(0.01)
    assert psrv.engines["bard"].snapshot.generation_tokens == before["bard"] + 3
    assert psrv.engines["course"].snapshot.generation_tokens == before["course"]


def test_64_streams_complete_and_16_disconnects_leave_nothing(psrv):
    body = {"model": "course", "prompt": PROMPTS[2], "max_tokens": 200, "stream": True,
            "ignore_eos": True}

    async def one(c, i):
        n = 0
        async with c.stream("POST", psrv.url + "/v1/completions", json={
                "model": "course", "prompt": PROMPTS[i % 3], "max_tokens": 8, "seed": i,
                "ignore_eos": True, "stream": True, "temperature": 0.7}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    n += sum(len(ch["text"]) > 0 for ch in json.loads(line[6:])["choices"])
        return n

    async def leave(c):
        async with c.stream("POST", psrv.url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            counts = await asyncio.gather(*[one(c, i) for i in range(64)])
            await asyncio.gather(*[leave(c) for _ in range(16)])
        await wait_idle(psrv.engines["course"])
        await asyncio.sleep(0.05)
        return counts
    counts = asyncio.run(go())
    assert all(n >= 1 for n in counts)
    snap = psrv.engines["course"].snapshot
    assert snap.requests == 0 and snap.running == 0 and snap.kv_blocks_used == 0
    text = httpx.get(psrv.url + "/metrics", timeout=10).text
    assert 'llm_stack:kv_cache_blocks_used{model_name="course"} 0.0' in text
    assert 'llm_stack:request_success_total{finished_reason="abort",model_name="course"}' in text


def test_overload_is_429(psrv, monkeypatch):
    monkeypatch.setattr(psrv.engines["course"], "max_waiting", 0)
    r = post(psrv, {"model": "course", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1


def test_timeout_is_408_and_frees_the_blocks(psrv, monkeypatch):
    monkeypatch.setattr(psrv.engines["course"], "request_timeout", 0.2)
    r = post(psrv, {"model": "course", "prompt": PROMPTS[0], "max_tokens": 400,
                    "ignore_eos": True})
    assert r.status_code == 408 and "timed out" in r.json()["error"]["message"]
    asyncio.run(wait_idle(psrv.engines["course"]))
    assert psrv.engines["course"].snapshot.kv_blocks_used == 0


def test_error_mid_stream_is_an_error_event_then_done(psrv, client):
    psrv.engines["course"].loop._inject("step", 3)
    r = post(psrv, {"model": "course", "prompt": PROMPTS[0], "max_tokens": 20, "stream": True,
                    "ignore_eos": True})
    ev = events(r)
    assert r.status_code == 200 and ev[-1] == b"[DONE]"
    assert "injected fault" in json.loads(ev[-2])["error"]["message"]
    r = client.completions.create(model="course", prompt=PROMPTS[0], max_tokens=4)
    assert r.usage.completion_tokens == 4  # the engine lives on


def test_a_crashed_engine_gives_errors_not_hangs(psrv):
    """Last in this module: the "bard" engine's process dies mid-stream (and is restarted:
    test_supervisor.py follows that through)."""
    bard = psrv.engines["bard"]

    async def go():
        async with httpx.AsyncClient(timeout=30) as c:
            async with c.stream("POST", psrv.url + "/v1/completions", json={
                    "model": "bard", "prompt": PROMPTS[0], "max_tokens": 300,
                    "ignore_eos": True, "stream": True}) as r:
                lines = []
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and not lines:
                        bard.loop._inject("crash", 3)
                    if line.startswith("data: "):
                        lines.append(line[6:])
                return lines
    lines = asyncio.run(asyncio.wait_for(go(), 30))
    assert lines[-1] == "[DONE]"
    assert "died (exit code 3)" in json.loads(lines[-2])["error"]["message"]
    health = httpx.get(psrv.url + "/health", timeout=10)
    assert health.status_code == 503 and health.json()["models"]["bard"]["alive"] is False
    r = post(psrv, {"model": "bard", "prompt": "x", "max_tokens": 2})  # it is restarting
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert "died" in r.json()["error"]["message"] and r.headers["retry-after"]
    assert post(psrv, {"model": "course", "prompt": "x", "max_tokens": 2}).status_code == 200


ORPHAN = """
import sys, time
import layer6_serving as l6
e = l6.AsyncEngine("course", engine_process=True, num_blocks=16, max_num_seqs=2)
print(e.loop.proc.pid, flush=True)
time.sleep(120)
"""


def test_the_engine_process_dies_with_its_server():
    """SIGKILL the server process: its engine process sees the pipe close and exits."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(l6.__file__)), os.environ.get("PYTHONPATH", "")]))
    server = subprocess.Popen([sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, env=env,
                              text=True)
    try:
        pid = int(server.stdout.readline())
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait(10)
    for _ in range(300):  # bounded: 30 s
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if _zombie(pid):
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError("the engine process outlived its server")


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
def test_tensor_parallel_inside_the_engine_process(offline):
    sp = l6.parallel.SamplingParams(temperature=0, max_tokens=12)
    want = offline.generate(["ROMEO.\n"], sp)[0].outputs[0].text
    with l6.start_server(["course"], tensor_parallel_size=2, num_blocks=64, dtype="float32",
                         engine_process=True) as srv:
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "model": "course", "prompt": "ROMEO.\n", "max_tokens": 12, "temperature": 0})
        assert r.json()["choices"][0]["text"] == want
