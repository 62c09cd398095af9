"""Server-sent events framed as OpenAI frames them, and disconnect handling.

A stream is `data: {json}\\n\\n` per chunk and `data: [DONE]\\n\\n` last. An error after the
response has started (HTTP 200 already sent) is a `data: {"error": {...}}` event, then
[DONE], so a client learns what happened instead of seeing a cut stream.

A client that disconnects: Starlette cancels the streaming task (it listens for
http.disconnect beside it), the cancellation reaches `await` inside the request's stream,
and the `finally` below aborts the request: its KV blocks are freed before the engine's
next step. A non-streamed request has no such listener: `until_disconnect` polls for one.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request

from ..request_stream import RequestStream
from ..streams import StreamOutput
from . import render
from .errors import from_exception
from .render import ChunkMaker, frame

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def events(stream: RequestStream, maker: ChunkMaker, n: int) -> AsyncIterator[bytes]:
    """The SSE body of one streamed request."""
    try:
        if maker.chat:
            for c in maker.role(n):
                yield frame(c)
        async for out in stream:
            payload = maker.payload(out)
            if payload:
                yield payload
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as e:  # noqa: BLE001 - every failure reaches the client as an event
        yield frame(from_exception(e).body())
    finally:
        await stream.aclose()  # a no-op when finished; otherwise the client left: abort
    yield DONE


async def batch_events(streams: list[RequestStream], maker: ChunkMaker, n: int
                       ) -> AsyncIterator[bytes]:
    """The SSE body of a batch of prompts: each prompt's chunks as they come (choices
    numbered prompt-major), one usage chunk (or a closing chunk) after the last."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                q.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the writer below
            q.put_nowait((i, e))
        q.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    finals: dict[int, StreamOutput] = {}
    try:
        open_ = len(streams)
        while open_:
            i, item = await q.get()
            if item is None:
                open_ -= 1
                continue
            if isinstance(item, Exception):
                raise item
            if item.finished:
                finals[i] = item
            out = dataclasses.replace(render.reindex(item, i, n), finished=False)
            payload = maker.payload(out)
            if payload:
                yield payload
        last = render.join_batch([finals[i] for i in sorted(finals)], n)
        yield b"".join(frame(c) for c in maker.chunks(dataclasses.replace(last, deltas=[])))
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as e:  # noqa: BLE001 - every failure reaches the client as an event
        yield frame(from_exception(e).body())
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()
    yield DONE


async def gather_all(streams: list[RequestStream]) -> list[StreamOutput]:
    """Every stream's whole output (a batch's requests run side by side); on failure or
    cancellation the others are aborted too."""
    tasks = [asyncio.ensure_future(s.collect()) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()


async def until_disconnect(request: Request, work: Awaitable, poll_s: float = 0.25):
    """Await `work`; cancel it (aborting its request) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise asyncio.CancelledError("client disconnected")
    finally:
        if not task.done():
            task.cancel()
