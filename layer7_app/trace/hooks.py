"""Where the spans come from, without changing the layers they measure.

Layer 6's public API is enough: `stack trace` builds the server itself from `AsyncEngine`
and `create_app`, so it can wrap the app in an ASGI middleware (the HTTP handler's span)
and wrap three methods *on that engine instance only* (as layer 6's sampler hook wraps the
sampler): the engine loop's `submit` (the request enters the async engine's queue), the
engine's `step` (one scheduler step: schedule, forward, sample) and its runner's `execute`
(the model forward). torch.profiler runs on the engine thread itself (it is started by the
first step after the request arrives and stopped by the step that finishes it), so the
kernels it sees are exactly this request's.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from .spans import Recorder

FORWARD = "model.forward"


class SpanMiddleware:
    """ASGI middleware: one span per POST /v1/... request, from its arrival to the last byte
    of its response (a streamed response included)."""

    def __init__(self, app: Any, recorder: Recorder, name: str, layer: int) -> None:
        self.app, self.rec, self.name, self.layer = app, recorder, name, layer

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/") \
                or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {}

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                # the span ends as the last bytes are handed over, not when this task next
                # runs (which may be after the client has them): spans stay nested
                self.rec.add(self.name, self.layer, start, time.perf_counter(),
                             path=scope["path"], status=status.get("code"))
            await send(message)

        await self.app(scope, receive, sending)


class EngineProbe:
    """Instruments one AsyncEngine (tensor_parallel_size 1): queue, steps, forwards, and a
    torch.profiler session on the engine thread around the traced request's steps."""

    def __init__(self, engine: Any, recorder: Recorder) -> None:
        self.engine, self.rec = engine, recorder
        self.submitted: float | None = None
        self.first_step: float | None = None
        self.forward_starts: list[float] = []
        self.profiler: torch.profiler.profile | None = None
        self.profile = None  # the finished profiler, once the request is done
        loop, llm = engine.loop, engine.llm
        self._submit, self._step, self._execute = loop.submit, llm.step, llm.runner.execute
        loop.submit, llm.step, llm.runner.execute = self.submit, self.step, self.execute

    def submit(self, req) -> None:
        if self.rec.enabled:
            self.submitted = time.perf_counter()
        self._submit(req)

    def step(self, *args, **kwargs):
        tracing = self.rec.enabled and self.submitted is not None
        if tracing and self.profiler is None and self.profile is None:
            self.profiler = torch.profiler.profile(activities=[
                torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()
        start = time.perf_counter()
        try:
            return self._step(*args, **kwargs)
        finally:
            end = time.perf_counter()
            if tracing:
                if self.first_step is None:
                    self.first_step = start
                    self.rec.add("engine.queue", 6, self.submitted, start)
                self.rec.add("scheduler.step", 4, start, end)
                if self.profiler is not None and not self.engine.llm.has_unfinished():
                    self.rec.add("engine.request", 6, self.submitted, end)
                    self.profiler.__exit__(None, None, None)  # slow: its own span, below
                    self.profile, self.profiler = self.profiler, None
                    self.rec.add("profiler.stop", 0, end, time.perf_counter())

    def execute(self, *args, **kwargs):
        if not (self.rec.enabled and self.submitted is not None):
            return self._execute(*args, **kwargs)
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(FORWARD):
                return self._execute(*args, **kwargs)
        finally:
            self.forward_starts.append(start)
            self.rec.add(FORWARD, 3, start, time.perf_counter())
