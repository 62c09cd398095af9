"""create_app: the FastAPI application over one or more AsyncEngines.

    app = create_app({"course": AsyncEngine("course")}, api_key=None)

Routes: /v1/models, /v1/completions, /v1/chat/completions (routes.py), GET /health (200
while every engine's loop, thread or process, is alive, else 503), GET /metrics (Prometheus
text). With an api_key, /v1/* needs `Authorization: Bearer <key>` (401 otherwise); /health
and /metrics stay open, as in vLLM, for probes and scrapers.
"""
from __future__ import annotations

import secrets

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..async_engine import AsyncEngine
from ..metrics import ServingMetrics
from . import errors
from .errors import OpenAIError
from .limits import MAX_BODY_BYTES, BodyLimit
from .routes import build_router


def create_app(engines: dict[str, AsyncEngine], *, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The OpenAI-compatible app serving `engines` (model name -> engine). Request bodies over
    max_body_bytes are refused (413) before they are read (limits.py)."""
    if not engines:
        raise ValueError("create_app needs at least one engine")
    app = FastAPI(title="llm-stack", version="0.1.0",
                  description="OpenAI-compatible server over llm-stack's engine (layer 6).")
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    metrics = ServingMetrics()
    for name, engine in engines.items():
        engine.loop.listeners.append(metrics.listener(name))
    app.state.engines, app.state.metrics = engines, metrics

    async def check_key(request: Request) -> None:
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                   api_key.encode()):
            raise OpenAIError(401, "Incorrect API key provided: send 'Authorization: Bearer "
                              "<key>' with the server's --api-key.", code="invalid_api_key")

    # no key: no dependency for FastAPI to resolve on every request
    app.include_router(build_router(engines),
                       dependencies=[Depends(check_key)] if api_key is not None else [])

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 with each engine's state while every engine serves; 503 with the reason when
        one is down (its process died, restarting), or stalled with requests open."""
        state = {}
        for name, e in engines.items():
            problem = e.problem()
            state[name] = {"alive": e.alive, "running": e.snapshot.running,
                           "waiting": e.snapshot.waiting, "kv_cache_usage": e.snapshot.kv_usage,
                           "restarts": e.loop.restarts,
                           **({"problem": problem} if problem else {})}
        ok = not any("problem" in s for s in state.values())
        body = {"status": "ok" if ok else "unhealthy", "models": state}
        if not ok:
            body["reason"] = "; ".join(f"{n}: {s['problem']}" for n, s in state.items()
                                       if "problem" in s)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        """Prometheus exposition of the server's metrics (metrics.py)."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
