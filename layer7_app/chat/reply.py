"""One assistant reply: prompt built, streamed from the model server, saved as it ends.

The page gets newline-delimited JSON events, one per line:
`{"type": "start", ...}`, `{"type": "citations", "citations": [...]}`,
`{"type": "delta", "text": "..."}` (many), then `{"type": "done", "message": {...}}` with the
stored reply and its stats, or `{"type": "error", "message": "..."}`.

The reply is saved as it streams: its row is written before the first token and its text
rewritten at most every SAVE_EVERY_S seconds, so a crash of the app loses at most that much
of it. Whatever happens, the reply is saved: finished, failed, or cut short because the
browser went away (Stop aborts its fetch; the response then closes this generator, which closes the
upstream stream and so aborts the request in the engine). A stopped reply is stored with
`"stopped": true` and the text that had arrived.
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from ..rag import DocIndex, context_message
from ..store import Store
from . import tools
from .prompt import CHARS_PER_TOKEN, Play, build_request
from .upstream import StreamResult, Upstream, UpstreamError


@dataclass
class ReplyRequest:
    """A validated reply request from the page."""

    model: str
    temperature: float
    max_tokens: int
    play: Play | None
    context_len: int | None
    seed: int | None = None
    system: str | None = None  # the conversation's system prompt
    tools: tuple[str, ...] = ()  # built-in tools the model may call (tools.py; chat mode only)
    tool_choice: str = "auto"  # "required": the first answer must be a call


SAVE_EVERY_S = 1.0  # how much of a streaming reply a crash may lose


def _event(kind: str, **fields: Any) -> bytes:
    return (json.dumps({"type": kind, **fields}) + "\n").encode()


def stats_of(result: StreamResult, wall_s: float, n_chunks: int) -> dict[str, Any]:
    """The numbers shown under a reply, from the server's final chunks."""
    extra, usage = result.llm_stack, result.usage
    return {
        "ttft_s": extra.get("ttft_s"),
        "tokens_per_s": extra.get("tokens_per_s"),
        "cached_prompt_tokens": extra.get("cached_prompt_tokens"),
        "spec_acceptance": extra.get("spec_acceptance"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens", n_chunks),
        "wall_s": round(wall_s, 3),
        "finish_reason": result.finish_reason,
    }


async def stream_reply(store: Store, upstream: Upstream, index: DocIndex | None, session: int,
                       conv_id: str, req: ReplyRequest) -> AsyncIterator[bytes]:
    """Generate the reply to the conversation's history, streaming events to the page."""
    # A reply that failed before its first token is kept for the page, not for the model.
    stored = store.messages(session, conv_id) or []
    history = ([{"role": m.role, "content": m.content} for m in stored if m.content]
               if req.play is not None else tools.expand_history(stored))
    citations: list[dict[str, object]] = []
    rag_text = None
    last_user = next((m["content"] for m in reversed(history) if m["role"] == "user"), "")
    if index is not None and last_user:
        passages = index.search(last_user, k=3)
        citations = [p.citation() for p in passages]
        if passages:
            # At most a third of the context for passages, so the conversation still fits.
            room = ((req.context_len or 4096) - req.max_tokens) // 3
            rag_text = context_message(passages, max_chars=int(room * CHARS_PER_TOKEN))
    path, body = build_request(history, model=req.model, temperature=req.temperature,
                         max_tokens=req.max_tokens, context_len=req.context_len,
                         play=req.play, rag_context=rag_text, system_prompt=req.system)
    if req.seed is not None:
        body["seed"] = req.seed
    if req.tools and req.play is None:
        body.update(tools=tools.definitions(req.tools), tool_choice=req.tool_choice,
                    parallel_tool_calls=False)  # one call a round: plenty for a small model
    yield _event("start", model=req.model)
    if citations:
        yield _event("citations", citations=citations)

    pieces: list[str] = []
    result = StreamResult()
    meta: dict[str, Any] = {"model": req.model, "citations": citations, "stopped": True}
    if req.play is not None:
        meta["speaker"] = req.play.assistant
    start = time.perf_counter()
    # the row exists from the start (meta "stopped" until it ends): a crash keeps the text
    row = store.add_message(session, conv_id, "assistant", "", meta)
    saved_at = time.monotonic()
    try:
        # aclosing: leaving this loop by an exception (Stop) must close the upstream stream
        # now, not whenever the garbage collector gets to the generator.
        async with aclosing(upstream.stream(path, body, result)) as pieces_in:
            async for text in pieces_in:
                pieces.append(text)
                if row is not None and time.monotonic() - saved_at >= SAVE_EVERY_S:
                    store.update_message(session, conv_id, row.id, "".join(pieces))
                    saved_at = time.monotonic()
                yield _event("delta", text=text)
        for round_ in range(tools.MAX_ROUNDS):  # the model called tools: run them, go on
            if not (req.tools and result.tool_calls):
                break
            calls, said = result.tool_calls, "".join(pieces)
            results = [tools.run_tool(c["function"]["name"], c["function"]["arguments"], index)
                       for c in calls]
            meta.setdefault("tool_calls", []).extend(calls)
            meta.setdefault("tool_results", []).extend(
                {"id": c["id"], "name": c["function"]["name"], "content": r}
                for c, r in zip(calls, results, strict=True))
            meta["tool_text"] = meta.get("tool_text", "") + said
            for c, r in zip(calls, results, strict=True):
                yield _event("tool_call", call=c)
                yield _event("tool_result", id=c["id"], name=c["function"]["name"], content=r)
            body = tools.follow_up(body, said, calls, results,
                                   last=round_ == tools.MAX_ROUNDS - 1,
                                   room=tools.room_after(req.context_len, result.usage, results))
            pieces, result = [], StreamResult()
            async with aclosing(upstream.stream(path, body, result)) as pieces_in:
                async for text in pieces_in:
                    pieces.append(text)
                    yield _event("delta", text=text)
        meta["stopped"] = False
    except UpstreamError as exc:
        meta["stopped"] = False
        meta["error"] = str(exc)
        yield _event("error", message=str(exc))
    finally:
        # Runs on success, on error and on cancellation (Stop): the reply is never lost.
        meta["stats"] = stats_of(result, time.perf_counter() - start, len(pieces))
        saved = None
        if row is not None and store.update_message(session, conv_id, row.id, "".join(pieces),
                                                    meta):
            saved = dataclasses.replace(row, content="".join(pieces), meta=meta)
    if saved is not None:
        yield _event("done", message={"id": saved.id, "role": "assistant",
                                      "content": saved.content, "meta": saved.meta})
