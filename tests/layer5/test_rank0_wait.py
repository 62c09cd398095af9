"""Rank 0's bounded wait for a step's CUDA event (runtime/rank0.py wait_event), with a stand-in
event and group (no GPU needed): it returns as soon as the event is done, polling without
napping at first; a worker found dead, or the group's timeout, ends it through the group's
guard (one error, the group failed)."""
from __future__ import annotations

import contextlib
import time

import pytest

from layer5_parallel.runtime import rank0


class Event:
    def __init__(self, done_after: int | None) -> None:
        self.polls, self.done_after = 0, done_after

    def query(self) -> bool:
        self.polls += 1
        return self.done_after is not None and self.polls > self.done_after


class Group:
    def __init__(self, timeout_s: float = 60.0, dead_after: float | None = None) -> None:
        self.timeout_s, self.failed_with, self.checks = timeout_s, None, 0
        self.start, self.dead_after = time.monotonic(), dead_after

    def check_alive(self) -> None:
        self.checks += 1
        if self.dead_after is not None and time.monotonic() - self.start > self.dead_after:
            raise RuntimeError("rank 1 exited (code 3)")

    @contextlib.contextmanager
    def guard(self, what: str):
        try:
            yield
        except BaseException as exc:
            self.failed_with = (what, exc)
            raise RuntimeError(f"tensor-parallel {what} failed on rank 0: {exc}") from exc


class Clock:
    """rank0's clock, virtual: each reading 1 us after the last, naps recorded, not slept (a
    busy machine cannot stretch 200 polls past the spin window)."""

    def __init__(self) -> None:
        self.now, self.naps = 0.0, []

    def monotonic(self) -> float:
        self.now += 1e-6
        return self.now

    def sleep(self, s: float) -> None:
        self.naps.append(s)


def test_returns_once_the_event_is_done_without_napping(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(rank0, "time", clock)
    naps = clock.naps
    event, group = Event(done_after=200), Group()
    rank0.wait_event(group, event, "reading a step's tokens")
    assert event.polls == 201 and naps == [] and group.failed_with is None


def test_a_dead_worker_ends_the_wait_through_the_guard():
    event, group = Event(done_after=None), Group(dead_after=0.0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        rank0.wait_event(group, event, "reading a step's tokens")
    # the liveness check (every CHECK_S) ended it, not the group's 60 s timeout: the match
    # above says so; the bound leaves a busy machine room
    assert time.monotonic() - start < 30
    assert group.failed_with[0] == "reading a step's tokens"


def test_the_group_timeout_ends_a_wait_that_never_finishes():
    event, group = Event(done_after=None), Group(timeout_s=0.2)
    with pytest.raises(RuntimeError, match=r"did not finish within the step limit of 0\.2 s \(tp_timeout_s\)"):
        rank0.wait_event(group, event, "sampling")
    assert isinstance(group.failed_with[1], TimeoutError) and group.checks >= 1
