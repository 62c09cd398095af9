"""What the chat app does for every request before its routes see it (ASGI middleware).

  headers     every response says how a browser may use it: the page loads scripts, styles
              and data from this origin only (Content-Security-Policy), may not be framed
              by another site (X-Frame-Options, frame-ancestors: no clickjacking), and no
              response is sniffed into another type (X-Content-Type-Options).
  origin      a state-changing request (POST, PUT, PATCH, DELETE) that carries an Origin
              header must come from this app's own origin: a page elsewhere cannot make the
              browser act for the user. (SameSite=Lax already keeps the session cookie off
              cross-site POSTs; this check holds too where the cookie rules do not, e.g. a
              sibling site on another port of the same host.) Requests without Origin (curl,
              scripts) are not browsers acting for a user and pass.
  one reply   replies to one conversation run one at a time, in arrival order: the question
              and its answer stay next to each other whatever the client sends at once, and
              Regenerate sees the reply it replaces. A conversation with MAX_WAITING replies
              already waiting answers 409.
"""
from __future__ import annotations

import asyncio
import json
import re
from urllib.parse import urlsplit

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
       "frame-ancestors 'none'")
HEADERS = [(b"content-security-policy", CSP.encode()), (b"x-frame-options", b"DENY"),
           (b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"same-origin")]
WRITES = {"POST", "PUT", "PATCH", "DELETE"}
REPLY = re.compile(r"^/api/conversations/([^/]+)/reply$")
MAX_WAITING = 8  # replies queued behind the running one, per conversation


class ChatGuard:
    """Security headers, the Origin check and one reply at a time per conversation."""

    def __init__(self, app) -> None:
        self.app = app
        self._locks: dict[str, asyncio.Lock] = {}
        self._waiting: dict[str, int] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(msg):
            if msg["type"] == "http.response.start":
                present = {k.lower() for k, _ in msg.get("headers", [])}
                msg["headers"] = list(msg.get("headers", [])) + [
                    (k, v) for k, v in HEADERS if k not in present]
            await send(msg)

        method = scope["method"]
        if method in WRITES and not _same_origin(scope):
            return await _refuse(403, "cross-origin request refused: the Origin header names "
                                 "another site", with_headers)
        m = REPLY.match(scope["path"]) if method == "POST" else None
        if m is None:
            return await self.app(scope, receive, with_headers)
        conv = m.group(1)
        if self._waiting.get(conv, 0) >= MAX_WAITING:
            return await _refuse(409, "this conversation already has replies waiting: send "
                                 "again once they are done", with_headers)
        lock = self._locks.setdefault(conv, asyncio.Lock())
        self._waiting[conv] = self._waiting.get(conv, 0) + 1
        try:
            async with lock:  # held until the whole streamed reply is sent (and saved)
                self._waiting[conv] -= 1
                await self.app(scope, receive, with_headers)
        finally:
            if not lock.locked() and self._waiting.get(conv) == 0:
                self._locks.pop(conv, None)
                self._waiting.pop(conv, None)


def _same_origin(scope) -> bool:
    headers = dict(scope["headers"])
    origin = headers.get(b"origin")
    if origin is None:
        return True
    host = headers.get(b"host", b"").decode("latin-1").lower()
    try:
        parts = urlsplit(origin.decode("latin-1").lower())
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    default = {"http": "80", "https": "443"}[parts.scheme]

    def norm(netloc: str) -> str:
        return netloc if ":" in netloc.rsplit("]", 1)[-1] else f"{netloc}:{default}"
    return norm(parts.netloc) == norm(host)


async def _refuse(status: int, message: str, send) -> None:
    body = json.dumps({"detail": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
