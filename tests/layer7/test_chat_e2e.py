"""The chat app end to end over HTTP against a real layer-6 server (the course model):
restarts keep every conversation, RAG cites its passages, `stack chat` serves and fails well."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from layer7_app.chat import COOKIE, start_chat
from layer7_app.store import Store


def reply(client: httpx.Client, conv_id: str, text: str, **options) -> list[dict]:
    """Send `text` and read the reply's events to the end."""
    body = {"model": "course", "content": text, "max_tokens": 12, "temperature": 0.0}
    body.update(options)
    with client.stream("POST", f"/api/conversations/{conv_id}/reply", json=body) as resp:
        assert resp.status_code == 200
        return [json.loads(line) for line in resp.iter_lines() if line]


def test_a_restart_keeps_every_conversation(model_server, tmp_path: Path) -> None:
    db = tmp_path / "chat.db"
    with start_chat(model_server.url, db=db) as chat:
        client = httpx.Client(base_url=chat.url, timeout=60)
        client.get("/")
        convs = [client.post("/api/conversations", json={}).json()["id"] for _ in range(3)]
        for i, conv in enumerate(convs):
            events = reply(client, conv, f"Speak, friend {i}.",
                           play={"user": "HORATIO", "assistant": "HAMLET"} if i else None)
            assert events[-1]["type"] == "done" and events[-1]["message"]["content"]
        before = {c: client.get(f"/api/conversations/{c}").json() for c in convs}
        cookies = dict(client.cookies)
    with start_chat(model_server.url, db=db) as chat:  # a new process would see the same
        client = httpx.Client(base_url=chat.url, timeout=60, cookies=cookies)
        listed = {c["id"] for c in client.get("/api/conversations").json()}
        assert listed == set(convs)
        for conv in convs:
            after = client.get(f"/api/conversations/{conv}").json()
            assert after["messages"] == before[conv]["messages"]
            assert [m["role"] for m in after["messages"]] == ["user", "assistant"]


def test_rag_puts_passages_in_the_prompt_and_cites_them(model_server, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "ghost.md").write_text("The ghost walks upon the platform at midnight.")
    (docs / "kernels.txt").write_text("Triton kernels tile the matrix multiplication.")
    with start_chat(model_server.url, db=tmp_path / "chat.db", docs=docs) as chat:
        client = httpx.Client(base_url=chat.url, timeout=60)
        assert "2 files indexed" in client.get("/").text
        conv = client.post("/api/conversations", json={}).json()["id"]
        events = reply(client, conv, "Where does the ghost walk?")
        cites = next(e for e in events if e["type"] == "citations")["citations"]
        assert [c["source"] for c in cites] == ["ghost.md"]
        done = events[-1]["message"]
        assert done["meta"]["citations"] == cites
        # The passage went into the prompt: more prompt tokens than the question alone.
        bare = reply(client, client.post("/api/conversations", json={}).json()["id"], "Hi.")
        assert done["meta"]["stats"]["prompt_tokens"] > bare[-1]["message"]["meta"]["stats"][
            "prompt_tokens"] + 5


def test_a_long_chat_is_cut_to_fit_the_context(model_server, tmp_path: Path) -> None:
    db = tmp_path / "chat.db"
    with start_chat(model_server.url, db=db) as chat:
        client = httpx.Client(base_url=chat.url, timeout=60)
        client.get("/")
        conv = client.post("/api/conversations", json={}).json()["id"]
        store = Store(db)  # forty long turns: far more than the course model's 512 tokens
        session = store.session_id(client.cookies[COOKIE])
        for i in range(40):
            store.add_message(session, conv, "user" if i % 2 == 0 else "assistant",
                              f"Turn {i}: " + "my lord, the king is come again " * 4)
        for play in (None, {"user": "HORATIO", "assistant": "HAMLET"}):
            done = reply(client, conv, "And what of it?", max_tokens=64, play=play)[-1]
            stats = done["message"]["meta"]["stats"]
            assert "error" not in done["message"]["meta"] and stats["completion_tokens"] > 0
            # the newest turns were kept (~300 tokens), the oldest dropped, and the request fit
            assert 200 < stats["prompt_tokens"] <= 512 - 64


def test_stack_chat_serves_the_page_and_refuses_mistakes(model_server, tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "from layer7_app.cli import main; main()", "chat"]
    proc = subprocess.Popen([*cmd, "--server", model_server.url, "--port", "0",
                             "--db", str(tmp_path / "chat.db")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # "chat: http://127.0.0.1:PORT  (...)"
        url = line.split()[1]
        assert url.startswith("http://127.0.0.1:")
        assert "llm-stack" in httpx.get(url, timeout=30).text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for args, message in ((["--docs", str(tmp_path / "none")], "not a directory"),
                          (["--server", "http://127.0.0.1:9"], "no OpenAI-compatible server"),
                          (["--port", "70000"], "--port"),
                          (["--model", "course", "--server", "http://x"], "exclusive")):
        done = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("error: ") and message in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
