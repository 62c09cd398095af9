"""The chat app's JSON API without a model: cookies, session isolation, input errors.

Nothing here reaches a model server (the upstream URL points at a closed port), so these
run in a second; replies are tested end to end in test_chat_e2e.py and test_browser.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from layer7_app.chat import COOKIE, create_chat_app
from layer7_app.store import Store

NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing listens there


@pytest.fixture()
def app(tmp_path: Path):
    return create_chat_app(NOWHERE, Store(tmp_path / "chat.db"))


def browser(app) -> TestClient:
    client = TestClient(app)
    page = client.get("/")
    assert page.status_code == 200 and "llm-stack" in page.text
    return client


def test_the_page_sets_an_httponly_samesite_session_cookie(app) -> None:
    client = TestClient(app)
    assert client.get("/api/conversations").status_code == 401  # no session yet
    page = client.get("/")
    cookie = page.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie
    assert "SameSite=lax" in cookie and "Path=/" in cookie
    assert "set-cookie" not in client.get("/").headers  # a known session keeps its cookie
    assert client.get("/api/conversations").json() == []


def test_one_session_never_sees_or_changes_anothers_chats(app) -> None:
    alice, bob = browser(app), browser(app)
    conv = alice.post("/api/conversations", json={"title": "alice's"}).json()
    assert [c["id"] for c in alice.get("/api/conversations").json()] == [conv["id"]]
    assert bob.get("/api/conversations").json() == []
    url = f"/api/conversations/{conv['id']}"
    assert bob.get(url).status_code == 404
    assert bob.patch(url, json={"title": "bob's"}).status_code == 404
    assert bob.post(url + "/reply", json={"model": "m", "content": "hi"}).status_code == 404
    assert bob.delete(url).status_code == 404
    assert alice.get(url).json()["title"] == "alice's"
    assert alice.get("/api/conversations/" + "0" * 32).status_code == 404  # unknown id: same


def test_bad_reply_requests_are_400_or_422_with_a_reason(app) -> None:
    client = browser(app)
    conv = client.post("/api/conversations", json={}).json()
    url = f"/api/conversations/{conv['id']}/reply"
    empty = client.post(url, json={"model": "m", "content": "  "})
    assert empty.status_code == 400 and "content" in empty.json()["detail"]
    regen = client.post(url, json={"model": "m", "regenerate": True})
    assert regen.status_code == 400 and "regenerate" in regen.json()["detail"]
    play = client.post(url, json={"model": "m", "content": "hi", "play": {"user": "<x>"}})
    assert play.status_code == 400 and "play" in play.json()["detail"]
    assert client.post(url, json={"model": "m", "content": "hi",
                                  "temperature": 9}).status_code == 422


def test_an_unreachable_model_server_is_a_clear_502(app) -> None:
    resp = browser(app).get("/api/models")
    assert resp.status_code == 502 and "unreachable" in resp.json()["detail"]
