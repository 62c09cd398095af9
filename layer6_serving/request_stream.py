"""RequestStream: what AsyncEngine.generate returns, one request's outputs as an async iterator.

The engine's loop (a thread or a process) puts each step's output for the request on the
request's asyncio queue; the stream hands the reader everything that arrived since its last
read, merged, so a reader that falls behind gets one item, not a backlog. Leaving the stream
early aborts the request; a deadline ends it with RequestTimeoutError even if the engine has
stalled.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from .engine_state import RequestTimeoutError
from .streams import StreamOutput, merge

if TYPE_CHECKING:
    from .async_engine import AsyncEngine


class RequestStream:
    """A request's async stream of StreamOutputs. Leaving it early (break, aclose, the task
    being cancelled) aborts the request. Each item is everything that arrived since the last
    read, merged (streams.merge): one engine step's deltas when the reader keeps up."""

    def __init__(self, engine: AsyncEngine, request_id: str, q: asyncio.Queue,
                 prompt_tokens: int, deadline: float | None = None) -> None:
        self.engine, self.request_id, self._q = engine, request_id, q
        self.deadline = deadline  # time.monotonic(): past it, the stream ends with a timeout
        self.prompt_tokens = prompt_tokens
        self.finished = False
        self._held: BaseException | None = None  # an error behind outputs: raised next time

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamOutput:
        if self._held is not None:
            self.finished, err, self._held = True, self._held, None
            raise err
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._next()
        except BaseException:  # cancelled while waiting (the client is gone), or timed out
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        items = [item]
        while not item.finished and not self._q.empty():
            item = self._q.get_nowait()
            if isinstance(item, BaseException):
                self._held = item
                break
            items.append(item)
        out = merge(items)
        self.finished = out.finished
        return out

    async def _next(self):
        if self.deadline is None:
            return await self._q.get()
        if not self._q.empty():
            return self._q.get_nowait()
        try:
            return await asyncio.wait_for(self._q.get(),
                                          max(0.0, self.deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise RequestTimeoutError(f"request {self.request_id} timed out (the engine did "
                                      f"not answer in time)") from None

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def collect(self) -> StreamOutput:
        """Run the request to the end: one StreamOutput whose deltas hold each completion's
        whole output (index order)."""
        outs = []
        async with self:
            async for out in self:
                outs.append(out)
        out = merge(outs)
        out.deltas.sort(key=lambda d: d.index)
        return out
