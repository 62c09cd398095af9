"""The chat app and its store under a hostile or unlucky client:

  - a page load writes no session row (the row comes with the session's first write);
  - every stored field has a size limit (a 5 MB settings PATCH is refused);
  - state-changing routes refuse another site's Origin; the page says CSP, no framing;
  - 8 sends at once to one conversation are stored question, answer, question, answer...
    and Regenerate then replaces only the last reply;
  - the chat app killed mid-reply: the reply streamed so far is in the database.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from layer7_app.chat import COOKIE, create_chat_app
from layer7_app.store import MAX_CONTENT_CHARS, Store

NOWHERE = "http://127.0.0.1:9"


def rows(db: Path, table: str) -> int:
    with sqlite3.connect(db) as c:
        return c.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]


def test_page_loads_write_no_session_rows(tmp_path: Path) -> None:
    db = tmp_path / "chat.db"
    app = create_chat_app(NOWHERE, Store(db))
    for _ in range(50):
        assert TestClient(app).get("/").status_code == 200
    client = TestClient(app)
    client.get("/")
    assert client.get("/api/conversations").json() == []  # a reader with nothing stored
    assert rows(db, "sessions") == 0
    conv = client.post("/api/conversations", json={}).json()  # the first write
    assert rows(db, "sessions") == 1
    assert [c["id"] for c in client.get("/api/conversations").json()] == [conv["id"]]
    other = TestClient(app)
    other.get("/")
    assert other.get("/api/conversations").json() == []  # not the first session's


def test_stored_fields_are_bounded(tmp_path: Path) -> None:
    store = Store(tmp_path / "chat.db")
    app = create_chat_app(NOWHERE, store)
    client = TestClient(app)
    client.get("/")
    conv = client.post("/api/conversations", json={}).json()
    big = {"x": "y" * (5 << 20)}
    r = client.patch(f"/api/conversations/{conv['id']}", json={"settings": big})
    assert 400 <= r.status_code < 500
    assert client.post("/api/conversations", json={"settings": big}).status_code in (400, 422)
    sid = store.session_id(client.cookies[COOKIE])
    with pytest.raises(ValueError):
        store.add_message(sid, conv["id"], "user", "x" * (MAX_CONTENT_CHARS + 1))
    with pytest.raises(ValueError):
        store.update_conversation(sid, conv["id"], settings={"x": "y" * (5 << 20)})
    assert store.conversation(sid, conv["id"]).settings == {}


def test_origin_check_and_security_headers(tmp_path: Path) -> None:
    client = TestClient(create_chat_app(NOWHERE, Store(tmp_path / "chat.db")))
    page = client.get("/")
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY"
    assert page.headers["x-content-type-options"] == "nosniff"
    evil = client.post("/api/conversations", json={}, headers={"Origin": "http://evil.example"})
    assert evil.status_code == 403 and "x-frame-options" in evil.headers
    assert client.post("/api/conversations", json={},
                       headers={"Origin": "http://evil.example:80"}).status_code == 403
    ok = client.post("/api/conversations", json={}, headers={"Origin": "http://testserver"})
    assert ok.status_code == 201
    assert client.post("/api/conversations", json={}).status_code == 201  # no Origin: a script
    assert client.get("/openapi.json").status_code == 404


async def _send(c: httpx.AsyncClient, url: str, body: dict) -> str:
    text = ""
    async with c.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line:
                ev = json.loads(line)
                assert ev["type"] != "error", ev
                if ev["type"] == "delta":
                    text += ev["text"]
    return text


def test_concurrent_sends_keep_question_answer_order(chat) -> None:
    async def main():
        async with httpx.AsyncClient(base_url=chat.url, timeout=120) as c:
            await c.get("/")
            conv = (await c.post("/api/conversations", json={})).json()
            url = f"/api/conversations/{conv['id']}/reply"
            sends = [asyncio.ensure_future(_send(c, url, {
                "model": "course", "content": f"question {i}", "max_tokens": 8,
                "temperature": 0}))
                for i in range(8)]
            await asyncio.gather(*sends)
            msgs = (await c.get(f"/api/conversations/{conv['id']}")).json()["messages"]
            roles = [m["role"] for m in msgs]
            assert roles == ["user", "assistant"] * 8, roles
            assert sorted(m["content"] for m in msgs[::2]) == [f"question {i}" for i in range(8)]
            before = [m["content"] for m in msgs]
            await _send(c, url, {"model": "course", "regenerate": True, "max_tokens": 8,
                                 "temperature": 0})
            after = (await c.get(f"/api/conversations/{conv['id']}")).json()["messages"]
            assert [m["content"] for m in after[:-1]] == before[:-1]  # only the last reply
            assert [m["role"] for m in after] == roles
    asyncio.run(main())


CHAT = "import sys; from layer7_app.chat.launch import main; sys.exit(main(sys.argv[1:]))"


def slow_model_server():
    """A stand-in model server that streams one word every 50 ms, forever (until the client
    leaves): the reply is surely mid-way when the chat app is killed."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from layer6_serving import AppThread, bind

    async def models(_):
        return JSONResponse({"object": "list", "data": [{"id": "slow", "object": "model"}]})

    async def chat(_):
        async def words():
            for i in range(100_000):
                chunk = {"choices": [{"index": 0, "delta": {"content": f"word{i} "}}]}
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(0.05)
        return StreamingResponse(words(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/models", models),
                            Route("/v1/chat/completions", chat, methods=["POST"])])
    return AppThread(app, bind("127.0.0.1", 0))


def test_a_reply_survives_the_chat_app_being_killed(tmp_path: Path) -> None:
    db = tmp_path / "chat.db"
    upstream = slow_model_server()
    sock = __import__("socket").socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-c", CHAT, "--server", upstream.url,
                             "--port", str(port), "--db", str(db)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        with httpx.Client(base_url=url, timeout=60) as c:
            c.get("/")
            conv = c.post("/api/conversations", json={}).json()
            got, t0 = "", None
            with c.stream("POST", f"/api/conversations/{conv['id']}/reply", json={
                    "model": "slow", "content": "Tell me a long story.",
                    "max_tokens": 2000}) as r:
                for line in r.iter_lines():
                    ev = json.loads(line) if line else {}
                    if ev.get("type") == "delta":
                        got += ev["text"]
                        t0 = t0 or time.monotonic()
                        if time.monotonic() - t0 > 2.5:  # past two save points
                            os.kill(proc.pid, signal.SIGKILL)
                            break
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        upstream.stop()
    store = Store(db)  # what the restarted app reads
    with sqlite3.connect(db) as conn:
        sid = conn.execute("SELECT id FROM sessions").fetchone()[0]
    msgs = store.messages(sid, conv["id"])
    assert [m.role for m in msgs] == ["user", "assistant"]
    partial = msgs[1].content
    assert partial and got.startswith(partial) and msgs[1].meta["stopped"] is True
    # saved at most a second (plus a save's own time) before the kill
    assert len(partial.split()) >= len(got.split()) - 30, (len(partial), len(got))


def test_lone_surrogates_are_4xx_not_5xx(tmp_path: Path) -> None:
    client = TestClient(create_chat_app(NOWHERE, Store(tmp_path / "chat.db")),
                        raise_server_exceptions=False)
    client.get("/")
    conv = client.post("/api/conversations", json={}).json()

    def send(method: str, path: str, body: dict) -> int:
        return client.request(method, path, content=json.dumps(body),  # "\udfff" as JSON sends it
                              headers={"content-type": "application/json"}).status_code
    url = f"/api/conversations/{conv['id']}"
    for method, path, body in (("POST", "/api/conversations", {"title": "\udfff"}),
                               ("POST", "/api/conversations", {"settings": {"a": "\ud800"}}),
                               ("PATCH", url, {"title": "\ud800"}),
                               ("POST", url + "/reply", {"model": "m", "content": "x\udfff"}),
                               ("POST", url + "/reply", {"model": "\udfff", "content": "x"})):
        assert 400 <= send(method, path, body) < 500, (method, path, body)
    assert client.get(url).status_code == 200
