"""Helpers for the router tests: read an SSE stream whole and say how it ended."""
from __future__ import annotations

import json

import httpx


def read_stream(client: httpx.Client, url: str, body: dict) -> dict:
    """POST a streaming request; returns {status, text, finish, error, done} where finish is
    the last finish_reason seen, error the first error event's message, done whether
    [DONE] came."""
    out = {"status": None, "text": "", "finish": None, "error": None, "done": False}
    with client.stream("POST", url, json=body) as resp:
        out["status"] = resp.status_code
        if resp.status_code != 200:
            resp.read()
            out["error"] = resp.json().get("error", {}).get("message", "?")
            return out
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                out["done"] = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                out["error"] = out["error"] or chunk["error"]["message"]
                continue
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                out["text"] += delta.get("content") or choice.get("text") or ""
                out["finish"] = choice.get("finish_reason") or out["finish"]
    return out


def chat_body(messages: list[dict], max_tokens: int = 12, stream: bool = True) -> dict:
    return {"model": "course", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
