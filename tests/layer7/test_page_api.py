"""The page's routes beyond chatting, against the real course model: the context meter's
count, branches from an edit or a regeneration, export / import, search, attachments."""
from __future__ import annotations

import base64
import json

import httpx
import pytest

from layer7_app.chat import start_chat


def pdf_with_text(text: str) -> bytes:
    """A one-page PDF whose page shows `text` (Helvetica), written by hand: the smallest
    file pypdf reads text from."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
               b"/Resources << /Font << /F1 5 0 R >> >> >>",
               b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1, xref)
    return bytes(out)


@pytest.fixture(scope="module")
def client(model_server, tmp_path_factory):
    with start_chat(model_server.url, db=tmp_path_factory.mktemp("api") / "chat.db") as chat, \
            httpx.Client(base_url=chat.url, timeout=120) as http:
        http.get("/").raise_for_status()
        yield http


def reply(client, conv: str, **body) -> dict:
    body = {"model": "course", "max_tokens": 6, "temperature": 0.0, **body}
    with client.stream("POST", f"/api/conversations/{conv}/reply", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        events = [json.loads(line) for line in resp.iter_lines() if line.strip()]
    return next(e for e in events if e["type"] == "done")["message"]


def test_count_uses_the_servers_tokenizer_and_says_what_will_not_fit(client) -> None:
    short = client.post("/api/count", json={"model": "course", "content": "Good morrow."}).json()
    assert short["estimated"] is False and short["fits"] and short["context_len"] == 512
    assert 3 <= short["prompt_tokens"] < 40
    long = client.post("/api/count", json={"model": "course", "content": "word " * 1000}).json()
    assert long["prompt_tokens"] > 512 and long["fits"] is False
    near = client.post("/api/count", json={"model": "course", "content": "word " * 300,
                                           "max_tokens": 400}).json()
    assert near["prompt_tokens"] < 512 and near["fits"] is False  # no room for the reply
    more = client.post("/api/count", json={"model": "course", "content": "Good morrow.",
                                           "system": "Thou art a ghost. " * 5}).json()
    assert more["prompt_tokens"] > short["prompt_tokens"]


def test_edit_and_regenerate_keep_branches_that_can_be_switched(client) -> None:
    conv = client.post("/api/conversations", json={"title": "branches"}).json()["id"]
    reply(client, conv, content="Who's there?")
    first = client.get(f"/api/conversations/{conv}").json()
    user_id = first["messages"][0]["id"]
    reply(client, conv, content="Nay, answer me.", edit_id=user_id)
    edited = client.get(f"/api/conversations/{conv}").json()
    assert [m["content"] for m in edited["messages"]][0] == "Nay, answer me."
    assert edited["branches"] == [{"position": 0, "count": 2, "live": 1}]
    reply(client, conv, regenerate=True, seed=3, temperature=1.0)
    regen = client.get(f"/api/conversations/{conv}").json()
    assert {"position": 1, "count": 2, "live": 1} in regen["branches"]
    # back to the first question: its own reply returns, the edit's branch points go with it
    assert client.post(f"/api/conversations/{conv}/branches",
                       json={"position": 0, "variant": 0}).status_code == 200
    back = client.get(f"/api/conversations/{conv}").json()
    assert [(m["role"], m["content"]) for m in back["messages"]] == \
        [(m["role"], m["content"]) for m in first["messages"]]
    assert back["branches"] == [{"position": 0, "count": 2, "live": 0}]
    client.post(f"/api/conversations/{conv}/branches", json={"position": 0, "variant": 1})
    again = client.get(f"/api/conversations/{conv}").json()
    assert again["messages"][0]["content"] == "Nay, answer me." and len(again["branches"]) == 2
    assert client.post(f"/api/conversations/{conv}/branches",
                       json={"position": 0, "variant": 7}).status_code == 400


def test_export_import_round_trip_and_search(client) -> None:
    conv = client.post("/api/conversations", json={"title": "x"}).json()["id"]
    client.patch(f"/api/conversations/{conv}", json={"system": "Speak in verse."})
    reply(client, conv, content="What of the wormwood?")
    md = client.get(f"/api/conversations/{conv}/export?format=md")
    assert md.status_code == 200 and "attachment" in md.headers["content-disposition"]
    assert "## You\n\nWhat of the wormwood?" in md.text and "Speak in verse." in md.text
    data = client.get(f"/api/conversations/{conv}/export?format=json").json()
    assert data["settings"]["system"] == "Speak in verse."
    made = client.post("/api/conversations/import", json=data)
    assert made.status_code == 201
    copy = client.get(f"/api/conversations/{made.json()['id']}").json()
    assert [m["content"] for m in copy["messages"]] == [m["content"] for m in data["messages"]]
    bad = client.post("/api/conversations/import", json={**data, "messages": [{"role": "x"}]})
    assert bad.status_code == 400 and "messages[0]" in bad.json()["detail"]
    found = client.get("/api/search", params={"q": "WORMWOOD"}).json()
    assert {f["id"] for f in found} == {conv, made.json()["id"]}
    assert "wormwood" in found[0]["snippet"]
    assert client.get("/api/search", params={"q": "no such words anywhere"}).json() == []


def test_an_attached_pdf_is_cited_in_the_reply(client) -> None:
    pdf = pdf_with_text("The ghost of Elsinore walks upon the battlements at midnight.")
    up = client.post("/api/attachments", json={
        "name": "ghost.pdf", "data_base64": base64.b64encode(pdf).decode()})
    assert up.status_code == 201 and up.json()["passages"] == 1, up.text
    conv = client.post("/api/conversations", json={}).json()["id"]
    message = reply(client, conv, content="Where walks the ghost?", attachments=["ghost.pdf"])
    assert [c["source"] for c in message["meta"]["citations"]] == ["ghost.pdf (attached)"]
    stored = client.get(f"/api/conversations/{conv}").json()["messages"][0]
    assert stored["meta"]["attachments"] == ["ghost.pdf"]
    bad = client.post("/api/attachments", json={"name": "x.exe", "data_base64": "AAAA"})
    assert bad.status_code == 400 and ".pdf" in bad.json()["detail"]
