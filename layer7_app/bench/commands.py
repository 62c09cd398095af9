"""Layer 7's commands for the `stack` CLI (entry point `llm_stack.layers` "7").

`run`: the chat app driven by a scripted conversation. It starts a layer-6 server for the
course model and the chat app in front of it (with one document to answer from), then
talks to the app as the page does (a session cookie, a conversation, replies streamed as
JSON lines) and prints, for each turn, what each layer did: the app's store and retrieval
(L7), the server's time to first token (L6), the engine's prefix cache (L4) and the model's
tokens (L3).
`bench`: the replica router's bench (prefix_aware vs round_robin on multi-turn chats).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

import layer6_serving as l6

from ..chat import start_chat
from .router import main as router_bench

TITLE = "chat app, sessions, RAG, replica router, CLI"

#: What the demo's user says, turn by turn (a scene, in play mode for the course model).
SCRIPT = ("What news from Verona, my lord?", "Who keeps the gate tonight?",
          "Speak of the ghost upon the platform.")
#: The one document the app answers from (RAG): its passages are cited under a reply.
DOC = ("The guard upon the platform at Elsinore is kept by Marcellus and Bernardo.\n\n"
       "At midnight the ghost of the late king walks upon the platform, in arms.\n\n"
       "Verona holds two households, alike in dignity, and an ancient grudge between them.\n")


def run(argv: list[str]) -> int:
    """`stack run --layer 7`: see the module docstring."""
    ap = argparse.ArgumentParser(prog="stack run --layer 7",
                                 description="The chat app driven by a scripted conversation.")
    ap.add_argument("--model", default="course", help="model to serve (default: course)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per reply (default 32)")
    args = ap.parse_args(argv)
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    with tempfile.TemporaryDirectory(prefix="llm-stack-l7-") as tmp:
        docs = Path(tmp) / "docs"
        docs.mkdir()
        (docs / "elsinore.txt").write_text(DOC)
        t0 = time.perf_counter()
        with l6.start_server([args.model]) as server:
            print(f"L6 server   {server.url}/v1 up in {time.perf_counter() - t0:.1f} s "
                  f"(model {args.model!r}; engine, parallel runtime, model and kernels beneath)")
            with start_chat(server.url, db=Path(tmp) / "chat.db", docs=docs) as chat:
                print(f"L7 chat app {chat.url} (store {Path(tmp) / 'chat.db'}, "
                      f"1 document indexed)\n")
                converse(chat.url, args.model, args.max_tokens)
            show_metrics(server.url, args.model)
    return 0


def converse(url: str, model: str, max_tokens: int) -> None:
    """The scripted conversation, through the app's JSON API as the page uses it."""
    with httpx.Client(base_url=url, timeout=120.0) as client:
        client.get("/").raise_for_status()  # the page: a session cookie
        info = {m["id"]: m for m in client.get("/api/models").json()["models"]}
        conv = client.post("/api/conversations", json={}).json()
        play = {"user": "HORATIO", "assistant": "HAMLET"} if "course" in model else None
        for turn, text in enumerate(SCRIPT, 1):
            body = {"content": text, "model": model, "max_tokens": max_tokens,
                    "temperature": 0.7, "seed": turn, "play": play}
            events = reply_events(client, conv["id"], body)
            done = next((e for e in events if e["type"] == "done"), None)
            if done is None:
                errors = [e.get("message") for e in events if e["type"] == "error"]
                raise RuntimeError(f"turn {turn}: no reply ({errors})")
            message = done["message"]
            stats = message["meta"].get("stats", {})
            cites = message["meta"].get("citations", [])
            who = play["user"] if play else "you"
            speaker = play["assistant"] if play else "assistant"
            print(f"turn {turn}  {who}: {text}\n        {speaker}: "
                  f"{' '.join(message['content'].split())[:160]}")
            print(f"  L7 app      history of {2 * turn - 1} message(s) sent; "
                  f"{len(cites)} passage(s) retrieved and cited"
                  + (f" ({cites[0]['source']} passage {cites[0]['passage']})" if cites else "")
                  + f"; reply stored as message {message['id']}")
            print(f"  L6 server   {sum(e['type'] == 'delta' for e in events)} pieces streamed; "
                  f"TTFT {_ms(stats.get('ttft_s'))}, {_num(stats.get('tokens_per_s'))} tok/s, "
                  f"finish {stats.get('finish_reason')}")
            print(f"  L4 engine   prefix cache: {stats.get('cached_prompt_tokens') or 0} of "
                  f"{stats.get('prompt_tokens')} prompt tokens found cached")
            print(f"  L3 model    {stats.get('prompt_tokens')} prompt + "
                  f"{stats.get('completion_tokens')} generated tokens "
                  f"(context {info.get(model, {}).get('max_model_len')})\n")
        stored = client.get(f"/api/conversations/{conv['id']}").json()
        print(f"L7 store    conversation {conv['id'][:8]}… {stored['title']!r}: "
              f"{len(stored['messages'])} messages in SQLite")


def reply_events(client: httpx.Client, conv_id: str, body: dict[str, Any]) -> list[dict]:
    """POST a reply request and read its newline-delimited JSON events to the end."""
    events = []
    with client.stream("POST", f"/api/conversations/{conv_id}/reply", json=body) as resp:
        if resp.status_code != 200:
            raise ValueError(f"the chat app refused the turn: HTTP {resp.status_code} "
                             f"{resp.read().decode(errors='replace')[:200]}")
        for line in resp.iter_lines():
            if line.strip():
                events.append(json.loads(line))
    return events


def show_metrics(server_url: str, model: str) -> None:
    """A few of the server's Prometheus counters after the conversation."""
    try:
        text = httpx.get(server_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return
    wanted = ("request_success_total", "prompt_tokens_total", "generation_tokens_total",
              "prefix_cache_hits_total", "prefix_cache_queries_total")
    found = []
    for line in text.splitlines():
        for name in wanted:
            if line.startswith(f"llm_stack:{name}{{") and f'model_name="{model}"' in line:
                found.append(f"{name} {float(line.rsplit(' ', 1)[1]):g}")
    if found:
        print("L6 metrics  " + ", ".join(found))


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.0f} ms"


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def bench(argv: list[str]) -> int:
    """`stack bench --layer 7`: the router's prefix_aware vs round_robin bench."""
    return router_bench(argv, prog="stack bench --layer 7")
