"""Spans: what `stack trace` records, and how they become a Chrome/Perfetto trace.

A span is (name, layer, start, end) on time.perf_counter's clock (seconds; one clock for every
thread of the process, so spans from the event loop and the engine thread line up). In the
trace JSON each layer is a process (pid = layer number, named by a metadata event) and each
span a complete event (ph "X", ts/dur in microseconds), which chrome://tracing and
ui.perfetto.dev draw as one row per layer, nested by time.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: pid -> the row's name in the trace viewer (a layer, or the client outside the stack).
LAYERS = {8: "client (outside the stack)", 7: "L7 router", 6: "L6 server + async engine",
          4: "L4 engine step (scheduler, sampling)", 3: "L3 model forward",
          1: "L1 kernels (aten ops, torch.profiler)", 0: "tracing overhead"}


@dataclass
class Span:
    name: str
    layer: int
    start: float  # perf_counter seconds
    end: float
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def dur(self) -> float:
        return self.end - self.start


class Recorder:
    """Collects spans from any thread while `enabled` (appends are atomic under the GIL)."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.enabled = False
        self._lock = threading.Lock()

    def add(self, name: str, layer: int, start: float, end: float, **args: Any) -> None:
        if self.enabled:
            with self._lock:
                self.spans.append(Span(name, layer, start, end, args))

    def named(self, name: str) -> list[Span]:
        return [s for s in self.spans if s.name == name]

    def one(self, name: str) -> Span:
        found = self.named(name)
        if len(found) != 1:
            raise RuntimeError(f"expected one {name!r} span, recorded {len(found)}")
        return found[0]


def chrome_trace(spans: list[Span], *, metadata: dict[str, Any] | None = None) -> dict:
    """The Chrome trace-event JSON object ({"traceEvents": [...]}) for `spans`; time zero is
    the first span's start."""
    t0 = min(s.start for s in spans)
    events: list[dict[str, Any]] = []
    for pid in sorted({s.layer for s in spans}, reverse=True):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": LAYERS.get(pid, f"layer {pid}")}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"sort_index": 10 - pid}})
    for s in sorted(spans, key=lambda s: (s.start, -s.dur)):
        events.append({"name": s.name, "cat": LAYERS.get(s.layer, "?"), "ph": "X",
                       "ts": round((s.start - t0) * 1e6, 3), "dur": round(s.dur * 1e6, 3),
                       "pid": s.layer, "tid": 0, "args": s.args})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata or {}}


def write_trace(path: Path, spans: list[Span], **metadata: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(spans, metadata=metadata)))
    return path
