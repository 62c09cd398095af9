"""The chat app's client for a layer-6 server's OpenAI-compatible API (httpx, async).

The app never talks to an engine directly: it proxies `POST /v1/chat/completions` (or
`/v1/completions`, for play mode) with `stream: true` and re-emits what it needs. Closing
the upstream stream early (the browser pressed Stop, or went away) closes the connection,
and the layer-6 server treats that as a client disconnect: it aborts the sequence and
frees its KV blocks at its next step.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

# Connecting should be quick; a stream may sit silent for a long prefill on a slow CPU,
# so reads get a generous timeout rather than none (nothing may hang forever).
TIMEOUT = httpx.Timeout(connect=5.0, read=300.0, write=30.0, pool=5.0)


def server_root(url: str) -> str:
    """A server's root URL from what a user pastes: `stack serve` prints `.../v1`, which
    OpenAI clients want; this app adds `/v1/...` itself."""
    root = url.strip().rstrip("/")
    return root[:-3].rstrip("/") if root.endswith("/v1") else root


class UpstreamError(RuntimeError):
    """The layer-6 server refused or failed a request; `status` is its HTTP status (0: none)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class StreamResult:
    """What a finished (or stopped) stream reported besides its text."""

    usage: dict[str, Any] = field(default_factory=dict)
    llm_stack: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # joined from the deltas


def merge_tool_call(calls: list[dict[str, Any]], piece: dict[str, Any]) -> None:
    """Add one streamed delta.tool_calls entry: a new index opens a call (id, name), later
    pieces of the same index append to its arguments."""
    i = piece.get("index", len(calls))
    fn = piece.get("function") or {}
    while len(calls) <= i:
        calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
    call = calls[i]
    call["id"] = piece.get("id") or call["id"]
    call["function"]["name"] += fn.get("name") or ""
    call["function"]["arguments"] += fn.get("arguments") or ""


def _error_text(body: bytes, status: int) -> str:
    """OpenAI's error body {"error": {"message": ...}}, or the raw text."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:300] or f"HTTP {status}"


class Upstream:
    """A layer-6 server at `base_url` (e.g. http://127.0.0.1:8000)."""

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        self.base_url = server_root(base_url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=self.base_url, timeout=TIMEOUT, headers=headers)

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self.client.aclose()

    async def models(self) -> list[dict[str, Any]]:
        """The server's `/v1/models` entries (each has at least an `id`)."""
        try:
            resp = await self.client.get("/v1/models")
        except httpx.HTTPError as exc:
            raise UpstreamError(f"model server {self.base_url} unreachable: {exc}") from exc
        if resp.status_code != 200:
            raise UpstreamError(_error_text(resp.content, resp.status_code), resp.status_code)
        return list(resp.json().get("data", []))

    async def count_tokens(self, model: str, *, prompt: str | None = None,
                           messages: list[dict[str, str]] | None = None) -> int | None:
        """The server's own count of a prompt's tokens (`POST /v1/tokenize`); None when it
        has no such endpoint or cannot count this text (the caller then estimates)."""
        body: dict[str, Any] = {"model": model}
        body.update({"messages": messages} if messages is not None else {"prompt": prompt or ""})
        try:
            resp = await self.client.post("/v1/tokenize", json=body)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        count = resp.json().get("count")
        return int(count) if isinstance(count, int) else None

    async def stream(self, path: str, payload: dict[str, Any],
                     result: StreamResult) -> AsyncIterator[str]:
        """POST `payload` to `path` (chat or plain completions) as a stream; yield the reply's
        text pieces as they arrive and fill `result` with usage and stats.

        Leaving the loop early (or cancelling the task) closes the connection, which is
        how a Stop reaches the engine.
        """
        body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with self.client.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    raise UpstreamError(_error_text(await resp.aread(), resp.status_code),
                                        resp.status_code)
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, SSE comments
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:  # an error mid-stream, sent as an event
                        raise UpstreamError(_error_text(data.encode(), 500), 500)
                    if chunk.get("usage"):
                        result.usage = chunk["usage"]
                    if chunk.get("llm_stack"):
                        result.llm_stack.update(chunk["llm_stack"])
                    for choice in chunk.get("choices") or []:
                        if choice.get("finish_reason"):
                            result.finish_reason = choice["finish_reason"]
                        for piece in (choice.get("delta") or {}).get("tool_calls") or []:
                            merge_tool_call(result.tool_calls, piece)
                        # chat chunks carry delta.content, completion chunks text
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                        if text:
                            yield text
        except httpx.HTTPError as exc:
            raise UpstreamError(f"model server {self.base_url}: {exc!r}") from exc
