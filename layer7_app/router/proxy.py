"""The router's HTTP app: an OpenAI-compatible proxy in front of layer-6 replicas.

    app = create_router_app(ReplicaSet(["http://127.0.0.1:8001", ...]), make_policy("prefix_aware"))

POST /v1/completions and /v1/chat/completions go to the replica the policy picks; the body is
passed on byte for byte and the answer comes back as it is, a stream chunk by chunk (SSE
frames are never re-parsed). GET /v1/models asks an available replica. The router's own:
GET /health (200 while some replica is available), GET /metrics (Prometheus text: each
replica's health and requests in flight), GET /router/replicas (JSON).

Failure rules (nothing hangs: every upstream call has connect/read/write/pool timeouts):
- a replica that refuses the connection is marked unhealthy and the request goes to the next
  one (it never reached the first, so retrying cannot run it twice); a 429 also moves on;
- no replica left: 503, OpenAI's error body;
- a replica that dies or times out before answering: 502 (504 for a timeout);
- one that dies mid-stream: an error event, then `data: [DONE]`, so a client never waits
  for a stream that will not end;
- a client that goes away closes the upstream stream at once, so the replica aborts the
  request and frees its KV blocks (layer 6 watches for that disconnect).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .replicas import Replica, ReplicaSet

FORWARDED_HEADERS = ("authorization", "content-type", "accept")


def error_body(message: str, kind: str = "server_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error_response(status: int, message: str, kind: str = "server_error",
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, code), status_code=status)


def error_event(message: str) -> bytes:
    """An OpenAI-style error event and the end of the stream, for a replica that died."""
    body = json.dumps(error_body(message, code="upstream_failed"))
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()


class ClosingStream(StreamingResponse):
    """A StreamingResponse that closes its body iterator however the response ends. Starlette
    cancels a streaming response when its client leaves, which may happen while the iterator
    sits at a `yield`; closing it here (not whenever the GC gets to it) closes the upstream
    stream now, so the replica aborts the request within a step."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def relay(resp: httpx.Response, replica: Replica) -> AsyncIterator[bytes]:
    """The replica's stream, chunk by chunk; an error event + [DONE] if it breaks."""
    try:
        async for chunk in resp.aiter_raw():
            yield chunk
        replica.served += 1
    except httpx.HTTPError as e:
        replica.failed += 1
        yield error_event(f"replica {replica.url} failed mid-stream ({type(e).__name__}); "
                          f"the reply is incomplete: retry the request")
    finally:
        replica.in_flight -= 1
        await resp.aclose()


async def until_disconnect(request: Request, work: asyncio.Future | Any) -> Any:
    """Await `work`; None if the client goes away first (polled every 0.25 s), and then
    `work` is cancelled, which closes the upstream request so the replica aborts it."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class Proxy:
    """Sends one request to a replica the policy picks, with failover before the answer."""

    def __init__(self, replicas: ReplicaSet, policy, client: httpx.AsyncClient) -> None:
        self.replicas, self.policy, self.client = replicas, policy, client

    async def forward(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error_response(400, f"the request body is not JSON: {e}",
                                  "invalid_request_error")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object",
                                  "invalid_request_error")
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        tried: set[int] = set()
        while True:
            candidates = [r for r in self.replicas.available() if id(r) not in tried]
            if not candidates:
                return error_response(503, "no replica is available to serve this request "
                                      "(all are down, draining or overloaded); retry later",
                                      code="no_replica")
            replica = self.policy.choose(candidates, body)
            tried.add(id(replica))
            replica.picked += 1
            replica.in_flight += 1
            try:
                up = self.client.build_request("POST", replica.url + path, content=raw,
                                               headers=headers)
                # a plain (non-streamed) answer's headers come only with the whole answer:
                # watch for the client leaving while waiting for them, too
                resp = await until_disconnect(request, self.client.send(up, stream=True))
            except (httpx.ConnectError, httpx.ConnectTimeout):
                replica.in_flight -= 1  # it never got the request: the next replica may
                replica.healthy, replica.failed = False, replica.failed + 1
                continue
            except httpx.HTTPError as e:
                replica.in_flight -= 1
                replica.failed += 1
                status = 504 if isinstance(e, httpx.TimeoutException) else 502
                return error_response(status, f"replica {replica.url} did not answer "
                                      f"({type(e).__name__})", code="upstream_failed")
            if resp is None:  # the client left; cancelling the send closed the upstream
                replica.in_flight -= 1
                return Response(status_code=499)
            if resp.status_code == 429 and len(tried) < len(self.replicas.replicas):
                replica.in_flight -= 1
                await resp.aclose()
                continue
            return await self._answer(request, resp, replica)

    async def _answer(self, request: Request, resp: httpx.Response, replica: Replica) -> Response:
        kind = resp.headers.get("content-type", "application/json")
        if kind.startswith("text/event-stream"):
            return ClosingStream(relay(resp, replica), status_code=resp.status_code,
                                 media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
        try:
            data = await until_disconnect(request, resp.aread())
            if data is None:  # nobody to answer: 499, nginx's "client closed request"
                return Response(status_code=499)
            replica.served += 1
            return Response(data, status_code=resp.status_code, media_type=kind)
        except httpx.HTTPError as e:
            replica.failed += 1
            return error_response(502, f"replica {replica.url} failed before its answer was "
                                  f"complete ({type(e).__name__}); retry", code="upstream_failed")
        finally:
            replica.in_flight -= 1
            await resp.aclose()

    async def models(self) -> Response:
        for replica in self.replicas.available():
            try:
                resp = await self.client.get(replica.url + "/v1/models", timeout=5)
            except httpx.HTTPError:
                continue
            return Response(resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type", "application/json"))
        return error_response(503, "no replica is available", code="no_replica")


def metrics_text(replicas: ReplicaSet) -> str:
    """The router's Prometheus exposition: per replica, healthy (0/1), in flight, served."""
    lines = []
    for name, kind, attr in (("router_replica_healthy", "gauge", "healthy"),
                             ("router_replica_requests_in_flight", "gauge", "in_flight"),
                             ("router_replica_requests_served", "counter", "served"),
                             ("router_replica_requests_failed", "counter", "failed")):
        lines.append(f"# TYPE llm_stack:{name} {kind}")
        for r in replicas.replicas:
            lines.append(f'llm_stack:{name}{{replica="{r.url}"}} {int(getattr(r, attr))}')
    return "\n".join(lines) + "\n"
