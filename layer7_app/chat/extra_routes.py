"""The page's routes beyond chatting: the context meter's token count, branches, export /
import, search and attachments. Each names its session through the same cookie as the rest
(`session`), and another session's conversation is a 404.

- `POST /api/count`: the prompt the model would get if the draft were sent now (history
  fitted, system prompt, play-mode scene), counted by the model server's own tokenizer
  (`/v1/tokenize`); `fits` says whether it leaves room for max_tokens of reply. A server
  without /v1/tokenize gets the app's conservative estimate, marked `"estimated": true`.
- `POST /api/conversations/{id}/branches`: show another branch at a position.
- `GET /api/conversations/{id}/export?format=md|json`, `POST /api/conversations/import`.
- `GET /api/search?q=`: conversations whose title or messages contain q.
- `POST /api/attachments`: a .txt/.md/.pdf file (base64) into this session's RAG index.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import Response
from pydantic import BaseModel, Field

from ..store import Store
from .attachments import Attachments, decode_upload, extract_text
from .branches import switch
from .prompt import Play, build_request, estimate_tokens
from .transfer import as_json, as_markdown, import_conversation, search
from .upstream import Upstream, UpstreamError


class CountBody(BaseModel):
    """Body of POST /api/count."""

    model: str = Field(..., min_length=1, max_length=200)
    content: str = Field("", max_length=100_000)
    conversation: str | None = Field(None, max_length=64)
    max_tokens: int = Field(128, ge=1, le=8192)
    play: dict[str, str] | None = None
    system: str | None = Field(None, max_length=20_000)  # a new chat's, not yet stored


class BranchBody(BaseModel):
    """Body of POST /api/conversations/{id}/branches."""

    position: int = Field(..., ge=0)
    variant: int = Field(..., ge=0)


class AttachmentBody(BaseModel):
    """Body of POST /api/attachments: the file's name and its bytes in base64."""

    name: str = Field(..., min_length=1, max_length=200)
    data_base64: str = Field(..., max_length=8 * 1024 * 1024)


def add_extra_routes(app: FastAPI, store: Store, upstream: Upstream, attachments: Attachments,
                     model_info: dict[str, dict[str, Any]],
                     session: Callable[..., int]) -> None:
    """Register the routes above on the chat app."""

    def conversation(sid: int, conv_id: str):
        conv = store.conversation(sid, conv_id)
        if conv is None:
            raise HTTPException(404, "no such conversation")
        return conv

    @app.post("/api/count")
    async def count(body: CountBody, sid: int = Depends(session)) -> dict[str, Any]:
        try:
            play = Play.parse(body.play)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from exc
        system = body.system
        history: list[dict[str, str]] = []
        if body.conversation:
            conv = conversation(sid, body.conversation)
            system = conv.settings.get("system") if system is None else system
            history = [{"role": m.role, "content": m.content}
                       for m in store.messages(sid, conv.id) or [] if m.content]
        if body.content.strip():
            history.append({"role": "user", "content": body.content})
        if body.model not in model_info:
            try:
                model_info.update({m["id"]: m for m in await upstream.models()})
            except UpstreamError as exc:
                raise HTTPException(502, str(exc)) from exc
        context_len = model_info.get(body.model, {}).get("max_model_len")
        _, request = build_request(history, model=body.model, temperature=0.0,
                                      max_tokens=body.max_tokens, context_len=context_len,
                                      play=play, system_prompt=system)
        counted = await upstream.count_tokens(body.model, prompt=request.get("prompt"),
                                              messages=request.get("messages"))
        estimated = counted is None
        if counted is None:
            texts = [request["prompt"]] if "prompt" in request else \
                [m["content"] for m in request["messages"]]
            counted = sum(estimate_tokens(t) for t in texts)
        room = (context_len - body.max_tokens) if context_len else None
        return {"prompt_tokens": counted, "context_len": context_len,
                "max_tokens": body.max_tokens, "fits": room is None or counted <= room,
                "estimated": estimated}

    @app.post("/api/conversations/{conv_id}/branches")
    def choose_branch(conv_id: str, body: BranchBody,
                      sid: int = Depends(session)) -> dict[str, str]:
        conversation(sid, conv_id)
        try:
            switch(store, sid, conv_id, body.position, body.variant)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from exc
        return {"status": "ok"}

    @app.get("/api/conversations/{conv_id}/export")
    def export(conv_id: str, format: str = "json", sid: int = Depends(session)) -> Response:
        conv = conversation(sid, conv_id)
        messages = store.messages(sid, conv_id) or []
        stem = "".join(c if c.isalnum() else "-" for c in conv.title)[:40].strip("-") or "chat"
        if format == "md":
            text, kind, ext = as_markdown(conv, messages), "text/markdown", "md"
        elif format == "json":
            text = json.dumps(as_json(conv, messages), indent=2, ensure_ascii=False)
            kind, ext = "application/json", "json"
        else:
            raise HTTPException(400, "format must be md or json")
        return Response(text, media_type=f"{kind}; charset=utf-8", headers={
            "Content-Disposition": f'attachment; filename="{stem}.{ext}"'})

    @app.post("/api/conversations/import", status_code=201)
    def import_json(data: dict[str, Any], sid: int = Depends(session)) -> dict[str, Any]:
        try:
            conv = import_conversation(store, sid, data)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from exc
        return vars(conv)

    @app.get("/api/search")
    def search_conversations(q: str = "", sid: int = Depends(session)) -> list[dict[str, Any]]:
        if len(q) > 200:
            raise HTTPException(400, "search for at most 200 characters")
        return search(store, sid, q)

    @app.post("/api/attachments", status_code=201)
    def attach(body: AttachmentBody, sid: int = Depends(session)) -> dict[str, Any]:
        try:
            text = extract_text(body.name, decode_upload(body.name, body.data_base64))
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from exc
        passages = attachments.add(sid, body.name, text)
        return {"name": body.name, "passages": passages, "chars": len(text)}
