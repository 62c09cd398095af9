"""create_app: the FastAPI application over one or more AsyncEngines.

    app = create_app({"course": AsyncEngine("course")}, api_key=None)

Routes: /v1/models, /v1/completions, /v1/chat/completions (routes.py), GET /health (200
while every engine serves, else 503 with the reason), GET /metrics (Prometheus text).

With an api_key, the server tells strangers nothing: /v1/* and /metrics need
`Authorization: Bearer <key>` (401 otherwise; open_metrics=True leaves /metrics open for a
Prometheus that cannot send one), /health answers a stranger only its status (a probe needs
no more; with the key it names the models and their state), and /docs, /redoc and
/openapi.json are off unless docs=True. Without a key, everything is open, docs included.
The OpenAPI schema documents the statuses the server answers (400, 401, 404, 413, 429, 503:
OpenAI's error body), not FastAPI's 422, which this server never sends.
"""
from __future__ import annotations

import secrets

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..async_engine import AsyncEngine
from ..metrics import ServingMetrics
from . import errors
from .errors import ERROR_RESPONSES, OpenAIError, openapi_schema
from .limits import MAX_BODY_BYTES, BodyLimit
from .routes import build_router


def create_app(engines: dict[str, AsyncEngine], *, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, docs: bool | None = None,
               open_metrics: bool = False) -> FastAPI:
    """The OpenAI-compatible app serving `engines` (model name -> engine). Request bodies over
    max_body_bytes are refused (413) before they are read (limits.py). docs: serve /docs and
    /openapi.json (default: only without an api_key). open_metrics: /metrics needs no key."""
    if not engines:
        raise ValueError("create_app needs at least one engine")
    docs = api_key is None if docs is None else docs
    app = FastAPI(title="llm-stack", version="0.1.0",
                  description="OpenAI-compatible server over llm-stack's engine (layer 6).",
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    metrics = ServingMetrics()
    for name, engine in engines.items():
        engine.loop.listeners.append(metrics.listener(name))
    app.state.engines, app.state.metrics = engines, metrics

    def key_ok(request: Request) -> bool:
        if api_key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(),
                                                                     api_key.encode())

    async def check_key(request: Request) -> None:
        if not key_ok(request):
            raise OpenAIError(401, "Incorrect API key provided: send 'Authorization: Bearer "
                              "<key>' with the server's --api-key.", code="invalid_api_key")

    # no key: no dependency for FastAPI to resolve on every request
    app.include_router(build_router(engines), responses=ERROR_RESPONSES,
                       dependencies=[Depends(check_key)] if api_key is not None else [])

    @app.get("/health", responses={503: {"description": "An engine is down or stalled"}})
    async def health(request: Request) -> JSONResponse:
        """200 with each engine's state while every engine serves; 503 with the reason when
        one is down (its process died, restarting), or stalled with requests open. With an
        api_key, a request without it gets the status alone."""
        state = {}
        for name, e in engines.items():
            problem = e.problem()
            state[name] = {"alive": e.alive, "running": e.snapshot.running,
                           "waiting": e.snapshot.waiting, "kv_cache_usage": e.snapshot.kv_usage,
                           "restarts": e.loop.restarts,
                           **({"problem": problem} if problem else {})}
        ok = not any("problem" in s for s in state.values())
        code = 200 if ok else 503
        if not key_ok(request):  # a probe learns up or down, not what is served
            return JSONResponse({"status": "ok" if ok else "unhealthy"}, status_code=code)
        body = {"status": "ok" if ok else "unhealthy", "models": state}
        if not ok:
            body["reason"] = "; ".join(f"{n}: {s['problem']}" for n, s in state.items()
                                       if "problem" in s)
        return JSONResponse(body, status_code=code)

    @app.get("/metrics", responses={401: ERROR_RESPONSES[401]},
             dependencies=[Depends(check_key)] if api_key and not open_metrics else [])
    async def prometheus() -> Response:
        """Prometheus exposition of the server's metrics (metrics.py)."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.openapi = lambda: openapi_schema(app)
    return app
