"""How commands reach an engine loop and how its outputs leave, in the server's process.

`ThreadCommands`: submit / abort from any thread put commands on a queue and wake the loop's
idle wait. `LoopSink`: a turn's outputs, with one call_soon_threadsafe per event loop (not
one per request), each item onto its request's asyncio queue. The engine process has the
same two pieces over a pipe (engine_worker.py: PipeCommands, PipeSink); the loop is the same.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterator


class ThreadCommands:
    """Commands from any thread: ("add", Request) and ("abort", request_id)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()

    def send(self, command: tuple) -> None:
        self._queue.put(command)
        self._wake.set()

    def wake(self) -> None:
        """End the loop's idle wait now (a stop)."""
        self._wake.set()

    def wait(self, loop, timeout: float) -> None:
        """Idle: until a command arrives (or a wake) or `timeout`."""
        self._wake.wait(timeout)

    def receive(self, loop) -> Iterator[tuple]:
        """The commands sent since the last call, in order."""
        self._wake.clear()
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return


class LoopSink:
    """In-process delivery: per turn, one call_soon_threadsafe per event loop (not one per
    request), which puts every item on its request's asyncio queue."""

    def flush(self, batch: list[tuple]) -> None:
        deliver(batch)


def deliver(batch) -> None:
    """(request, item) pairs -> each item on its request's asyncio queue, with one
    call_soon_threadsafe per event loop (the thread and process front ends both use it)."""
    by_loop: dict = {}
    for req, item in batch:
        by_loop.setdefault(req.loop, []).append((req.queue, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(put_all, items)
        except RuntimeError:  # its event loop is closed: the client is long gone
            pass


def put_all(items) -> None:
    for q, item in items:
        q.put_nowait(item)
