"""The chat web app: a FastAPI app of its own in front of a layer-6 model server.

It serves one server-rendered page (jinja2) with plain JavaScript and CSS (no build
step), a small JSON API over the SQLite store, and `POST /api/conversations/{id}/reply`,
which streams the model's reply as newline-delimited JSON (see reply.py).

Sessions: the page sets a random token in an HttpOnly, SameSite=Lax cookie (scripts cannot
read it; another site's page cannot make the browser send it with a POST, and a JSON POST
from another origin would need CORS, which this app never grants). Lax, not Strict: with
Strict, following a link to the app from another site would arrive without the cookie and
start a new, empty session. Every API call names its session through the cookie, and a
conversation of another session answers 404, exactly like one that does not exist.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from pydantic import AfterValidator, BaseModel, Field

from ..rag import DocIndex
from ..store import TOKEN, Store
from . import tools as tool_defs
from .attachments import Attachments
from .branches import branch_points, fork
from .extra_routes import add_extra_routes
from .guard import ChatGuard
from .prompt import Play
from .reply import ReplyRequest, stream_reply
from .upstream import Upstream, UpstreamError

HERE = Path(__file__).parent
COOKIE = "llmstack_session"
COOKIE_AGE_S = 365 * 24 * 3600
NO_ROWS = -1  # the session id of a cookie whose session has not written yet: matches nothing
MAX_CLIENT_SETTINGS_BYTES = 16 * 1024  # settings a client sends (the page's are a few dozen)


def _small(settings: dict[str, Any] | None) -> dict[str, Any] | None:
    if settings is not None and len(json.dumps(settings)) > MAX_CLIENT_SETTINGS_BYTES:
        raise ValueError(f"settings are at most {MAX_CLIENT_SETTINGS_BYTES} bytes as JSON")
    return settings


def _too_large(_: Request, exc: ValueError) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=400)


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator when the response ends.

    When the browser disconnects, Starlette cancels the task that iterates the body; a
    generator left suspended at a `yield` would only be closed by the garbage collector,
    later, so the model server would go on generating for nobody. Closing it here runs its
    cleanup at once: the upstream stream closes and the engine drops the request.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class NewConversation(BaseModel):
    """Body of POST /api/conversations."""

    title: str = Field("New chat", max_length=200)
    settings: Annotated[dict[str, Any], AfterValidator(_small)] = Field(default_factory=dict)


class ConversationPatch(BaseModel):
    """Body of PATCH /api/conversations/{id}."""

    title: str | None = Field(None, max_length=200)
    settings: Annotated[dict[str, Any] | None, AfterValidator(_small)] = None
    system: str | None = Field(None, max_length=20_000)  # the system prompt ("" clears it)


class ReplyBody(BaseModel):
    """Body of POST /api/conversations/{id}/reply: a new user message, an edit of a sent one
    (`edit_id`: the old line is kept as a branch), or a regeneration (the same)."""

    content: str | None = Field(None, max_length=100_000)
    regenerate: bool = False
    edit_id: int | None = None
    attachments: list[str] = Field(default_factory=list, max_length=20)
    model: str = Field(..., min_length=1, max_length=200)
    temperature: float = Field(0.8, ge=0.0, le=2.0)
    max_tokens: int = Field(128, ge=1, le=8192)
    play: dict[str, str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)  # same seed, same reply
    tools: list[str] = Field(default_factory=list, max_length=8)  # built-ins (chat/tools.py)
    tool_choice: Literal["auto", "required"] = "auto"


def create_chat_app(upstream_url: str, store: Store, index: DocIndex | None = None,
                    api_key: str | None = None) -> FastAPI:
    """The chat app for the model server at `upstream_url`, keeping chats in `store`."""
    upstream = Upstream(upstream_url, api_key=api_key)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await upstream.aclose()

    app = FastAPI(title="llm-stack chat", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.add_middleware(ChatGuard)  # headers, Origin check, one reply at a time (guard.py)
    app.add_exception_handler(ValueError, _too_large)  # the store's size limits: a 400
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    templates = Jinja2Templates(directory=HERE / "templates")  # autoescapes .html
    attachments = Attachments(index)
    app.state.store, app.state.upstream, app.state.index = store, upstream, index
    model_info: dict[str, dict[str, Any]] = {}

    def session(request: Request) -> int:
        token = request.cookies.get(COOKIE)
        sid = store.session_id(token)
        if sid is not None:
            return sid
        if token and TOKEN.fullmatch(token):
            if request.method in ("GET", "HEAD"):
                return NO_ROWS  # a session that has written nothing has nothing to read
            return store.ensure_session(token)  # its first write: the row is made now
        raise HTTPException(401, "no session: load the chat page first")

    def owned(sid: int, conv_id: str) -> None:
        if store.conversation(sid, conv_id) is None:
            raise HTTPException(404, "no such conversation")

    @app.get("/", response_class=HTMLResponse)
    def index_page(request: Request) -> HTMLResponse:
        token = request.cookies.get(COOKIE)
        # a cookie, but no row: the row is written with the session's first write
        new_token = None if token and TOKEN.fullmatch(token) else store.new_token()
        docs = index.sources if index is not None else []
        resp = templates.TemplateResponse(request, "index.html", {"docs": docs})
        if new_token:
            resp.set_cookie(COOKIE, new_token, max_age=COOKIE_AGE_S, httponly=True,
                            samesite="lax", path="/")
        return resp

    @app.get("/api/models")
    async def models(_: int = Depends(session)) -> dict[str, Any]:
        try:
            data = await upstream.models()
        except UpstreamError as exc:
            raise HTTPException(502, str(exc)) from exc
        model_info.update({m["id"]: m for m in data})
        return {"models": [{"id": m["id"], "max_model_len": m.get("max_model_len")}
                           for m in data]}

    @app.get("/api/conversations")
    def list_conversations(sid: int = Depends(session)) -> list[dict[str, Any]]:
        return [vars(c) for c in store.conversations(sid)]

    @app.post("/api/conversations", status_code=201)
    def new_conversation(body: NewConversation, sid: int = Depends(session)) -> dict[str, Any]:
        return vars(store.create_conversation(sid, body.title, body.settings))

    @app.get("/api/conversations/{conv_id}")
    def get_conversation(conv_id: str, sid: int = Depends(session)) -> dict[str, Any]:
        conv = store.conversation(sid, conv_id)
        if conv is None:
            raise HTTPException(404, "no such conversation")
        return {**vars(conv), "messages": [vars(m) for m in store.messages(sid, conv_id) or []],
                "branches": branch_points(conv.settings)}

    @app.patch("/api/conversations/{conv_id}")
    def patch_conversation(conv_id: str, body: ConversationPatch,
                           sid: int = Depends(session)) -> dict[str, str]:
        conv = store.conversation(sid, conv_id)
        settings = body.settings
        if conv is not None and body.system is not None:
            settings = {**(conv.settings if settings is None else settings),
                        "system": body.system}
        if conv is None or not store.update_conversation(sid, conv_id, title=body.title,
                                                         settings=settings):
            raise HTTPException(404, "no such conversation")
        return {"status": "ok"}

    @app.delete("/api/conversations/{conv_id}")
    def delete_conversation(conv_id: str, sid: int = Depends(session)) -> dict[str, str]:
        if not store.delete_conversation(sid, conv_id):
            raise HTTPException(404, "no such conversation")
        return {"status": "deleted"}

    @app.post("/api/conversations/{conv_id}/reply")
    async def reply(conv_id: str, body: ReplyBody,
                    sid: int = Depends(session)) -> ClosingStreamingResponse:
        owned(sid, conv_id)
        try:
            play = Play.parse(body.play)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from exc
        messages = store.messages(sid, conv_id) or []
        try:
            if body.regenerate:  # the last reply becomes a branch, a new one is written
                last = max((i for i, m in enumerate(messages) if m.role == "user"), default=None)
                if last is None:
                    raise HTTPException(400, "nothing to regenerate: the chat has no user "
                                             "message")
                if last + 1 < len(messages):
                    fork(store, sid, conv_id, last + 1)
            elif body.content and body.content.strip():
                meta = {"attachments": body.attachments} if body.attachments else {}
                if body.edit_id is not None:  # the old line from that message is kept
                    at = next((i for i, m in enumerate(messages)
                               if m.id == body.edit_id and m.role == "user"), None)
                    if at is None:
                        raise HTTPException(400, f"no message {body.edit_id} of yours to edit")
                    fork(store, sid, conv_id, at)
                elif not any(m.role == "user" for m in messages):
                    store.update_conversation(sid, conv_id, title=body.content.strip()[:60])
                store.add_message(sid, conv_id, "user", body.content, meta)
            else:
                raise HTTPException(400, "send a non-empty 'content' or 'regenerate': true")
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from exc
        conv = store.conversation(sid, conv_id)
        settings = dict(conv.settings) if conv is not None else {}
        settings.update(model=body.model, temperature=body.temperature,
                        max_tokens=body.max_tokens, play=body.play)
        store.update_conversation(sid, conv_id, settings=settings)
        if body.model not in model_info:  # the page lists models first; a script may not
            try:
                model_info.update({m["id"]: m for m in await upstream.models()})
            except UpstreamError as exc:
                raise HTTPException(502, str(exc)) from exc
        info = model_info.get(body.model, {})
        try:
            tool_defs.definitions(body.tools)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from exc
        req = ReplyRequest(body.model, body.temperature, body.max_tokens, play,
                           info.get("max_model_len"), body.seed, settings.get("system"),
                           tuple(body.tools), body.tool_choice)
        return ClosingStreamingResponse(stream_reply(store, upstream, attachments.index_for(sid),
                                                     sid, conv_id, req),
                                 media_type="application/x-ndjson",
                                 headers={"Cache-Control": "no-store"})

    add_extra_routes(app, store, upstream, attachments, model_info, session)
    return app
