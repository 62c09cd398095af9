"""cuda_events.record on a CUDA GPU (skipped without one): the event lands on the stream that
event.record() picks (the current device's current stream, a side stream inside
`torch.cuda.stream`), whether the cached stream lookup is on or off; its switch is strict."""
from __future__ import annotations

import pytest
import torch

from layer4_algorithms import cuda_events


@pytest.mark.gpu
@pytest.mark.parametrize("cached", [False, True])
def test_record_lands_on_the_current_stream(monkeypatch, cached):
    monkeypatch.setattr(cuda_events, "CACHED", cached)
    assert cuda_events.current_stream() == torch.cuda.current_stream()
    side = torch.cuda.Stream()
    busy, idle = torch.cuda.Event(), torch.cuda.Event()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        assert cuda_events.current_stream() == side
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles on the side stream
        cuda_events.record(busy)
    cuda_events.record(idle)  # the default stream: nothing queued on it
    idle.synchronize()
    assert not busy.query()  # behind the side stream's sleep, not the default stream's work
    busy.synchronize()
    assert busy.query()
    assert cuda_events.current_stream() is cuda_events.current_stream()  # made once


def test_switch_is_strict(monkeypatch):
    monkeypatch.setenv("LLM_STACK_CACHED_STREAM", "on")
    with pytest.raises(ValueError, match="LLM_STACK_CACHED_STREAM must be 0 or 1"):
        cuda_events._switch()
    monkeypatch.setenv("LLM_STACK_CACHED_STREAM", "0")
    assert not cuda_events._switch()
    monkeypatch.delenv("LLM_STACK_CACHED_STREAM")
    assert cuda_events._switch()  # on by default
