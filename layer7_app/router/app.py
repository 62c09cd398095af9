"""create_router_app: the FastAPI app of the router, and start_router to run it in a thread.

    with start_router(["http://127.0.0.1:8001", "http://127.0.0.1:8002"],
                      policy="prefix_aware") as router:
        openai.OpenAI(base_url=router.url + "/v1", api_key="x").chat.completions.create(...)
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import layer6_serving as l6

from .autoscale import Autoscaler
from .policies import make_policy
from .proxy import Proxy, error_response, metrics_text
from .replicas import ReplicaSet

#: Seconds without a byte from a replica before a request fails. Between bytes, not in all:
#: a long stream is fine as long as tokens keep coming.
READ_TIMEOUT = 120.0


def create_router_app(replicas: ReplicaSet, policy, *, autoscaler: Autoscaler | None = None,
                      read_timeout: float = READ_TIMEOUT) -> FastAPI:
    """The router over `replicas` choosing by `policy` (policies.py)."""
    state: dict[str, Proxy] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(connect=2.0, read=read_timeout, write=10.0, pool=10.0)
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            state["proxy"] = Proxy(replicas, policy, client)
            await replicas.check_all(client)
            replicas.start(client)
            if autoscaler is not None:
                await autoscaler.start(replicas)
            try:
                yield
            finally:
                if autoscaler is not None:
                    await autoscaler.stop()
                await replicas.stop()

    app = FastAPI(title="llm-stack router", lifespan=lifespan,
                  description="OpenAI-compatible proxy over layer-6 replicas (layer 7).")
    app.state.replicas, app.state.policy, app.state.autoscaler = replicas, policy, autoscaler

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await state["proxy"].forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await state["proxy"].forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        return await state["proxy"].models()

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = bool(replicas.available())
        return JSONResponse({"status": "ok" if ok else "unhealthy", "policy": policy.name,
                             "replicas": [r.state() for r in replicas.replicas]},
                            status_code=200 if ok else 503)

    @app.get("/router/replicas")
    async def replica_states() -> dict:
        events = autoscaler.events if autoscaler is not None else []
        return {"policy": policy.name, "replicas": [r.state() for r in replicas.replicas],
                "autoscale_events": events}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics_text(replicas))

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def unknown(rest: str) -> JSONResponse:
        return error_response(404, f"the router has no route /v1/{rest}",
                              "invalid_request_error", "not_found")

    return app


class RouterHandle:
    """A router running in a background thread: `url`, `app`, `replicas`, `stop()`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app, self.replicas = app, app.state.replicas
        # 60 s to start: an autoscaler starts its first replicas first
        self._http = l6.AppThread(app, l6.bind(host, port), name="router", start_timeout=60,
                                  stop_timeout=30)
        self.port, self.url = self._http.port, self._http.url

    @property
    def alive(self) -> bool:
        return self._http.alive

    def stop(self) -> None:
        self._http.stop()

    def __enter__(self) -> RouterHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_router(replica_urls: list[str], *, policy: str = "round_robin", host: str =
                 "127.0.0.1", port: int = 0, load_bound: int = 4,
                 autoscaler: Autoscaler | None = None, health_interval: float = 1.0,
                 read_timeout: float = READ_TIMEOUT) -> RouterHandle:
    """Run a router over `replica_urls` (and/or an autoscaler's replicas) in a thread."""
    if not replica_urls and autoscaler is None:
        raise ValueError("the router needs at least one --replica URL (or --model with "
                         "--min-replicas to start its own)")
    replicas = ReplicaSet(replica_urls, interval=health_interval)
    app = create_router_app(replicas, make_policy(policy, load_bound=load_bound),
                            autoscaler=autoscaler, read_timeout=read_timeout)
    return RouterHandle(app, host, port)
