"""The engine process's side (engine_process.py is the server's): build layer 5's LLM, say
what it is (EngineInfo), then run the same EngineLoop as in-process, with the pipe as its
transport: `PipeCommands` (commands down the pipe) and `PipeSink` (one message per turn up).
"""
from __future__ import annotations

import contextlib
import copy
import gc
import os
import pickle
import signal
import struct
import sys
import time
import traceback
from collections.abc import Iterator

from .engine_loop import EngineLoop
from .engine_state import EngineInfo, EngineSnapshot, Request
from .streams import DeltaTracker


class PipeCommands:
    """The engine process's commands (add, abort, stop, fault) come down the pipe, and the
    loop's own thread reads them, between steps and, when idle, by waiting on the pipe
    itself. No reader thread hands them over: that cost a GIL handoff and an Event wake-up
    per request (an add reaching an idle engine starts its prefill at once) and took the
    GIL from the stepping thread whenever a command came in mid-step. End of file on the
    pipe (the server exited, even by SIGKILL) stops the loop."""

    def __init__(self, conn, token_text) -> None:
        self.conn, self.token_text = conn, token_text

    def wake(self) -> None:
        pass  # a stop comes from the loop's own thread here: nothing waits

    def wait(self, loop: EngineLoop, timeout: float) -> None:
        try:
            self.conn.poll(timeout)  # wakes as soon as a command (or end of file) arrives
        except (OSError, ValueError):
            loop.request_stop()

    def receive(self, loop: EngineLoop) -> Iterator[tuple]:
        conn = self.conn
        try:
            while not loop._stop and conn.poll(0):
                msg = conn.recv()
                kind = msg[0]
                if kind == "add":
                    _, rid, ids, params, priority, timeout = msg
                    deadline = None if timeout is None else time.perf_counter() + timeout
                    yield "add", Request(rid, ids, params, priority, deadline, None, None,
                                         DeltaTracker(self.token_text))
                elif kind == "abort":
                    yield "abort", msg[1]
                elif kind == "fault":
                    _fault(loop, msg[1], msg[2])
                elif kind == "stop":
                    loop.request_stop()
        except (EOFError, OSError, ValueError):  # the server exited: stop with it
            loop.request_stop()


class PipeSink:
    """The engine process's side: each turn's items, the finished requests' timings (it is a
    listener) and the snapshot (when it changed: taken at the end of the turn, token counts
    included) go to the server as one message. Written without blocking: a pipe whose
    reader is busy would block its writer, and the engine must not wait for the server;
    what the pipe cannot take yet waits in `backlog` and goes with the next turn."""

    packed = True  # the loop hands over outputs as streams.pack makes them

    def __init__(self, conn, loop: EngineLoop | None = None) -> None:
        self.conn, self.loop = conn, loop
        self._last: EngineSnapshot | None = None
        self._finished: list = []
        self._dequeued = -1
        self.backlog = bytearray()
        self._fd = conn.fileno()
        os.set_blocking(self._fd, False)

    def on_step(self, snapshot: EngineSnapshot) -> None:
        pass  # read at the end of the turn instead

    def on_finish(self, done) -> None:
        self._finished.append(done)

    def flush(self, batch) -> None:
        snap, dequeued = self.loop.snapshot, self.loop._dequeued
        changed = snap != self._last
        if batch or changed or self._finished or dequeued != self._dequeued:
            if changed:
                self._last = copy.copy(snap)
            items = [(req.request_id, item) for req, item in batch]  # outputs come packed
            self._queue(("step", items, self._last if changed else None, self._finished,
                         dequeued))
            self._finished, self._dequeued = [], dequeued
        self._drain()

    def _queue(self, msg) -> None:
        """Frame as multiprocessing's Connection does (its recv() reads it): length, pickle."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self.backlog += struct.pack("!i", len(data)) + data

    def _drain(self) -> None:
        while self.backlog:
            try:
                n = os.write(self._fd, self.backlog)
            except BlockingIOError:
                return
            except OSError:  # the server is gone: nobody to serve
                self.backlog.clear()
                self.loop.request_stop()
                return
            del self.backlog[:n]

    def close(self, last) -> None:
        """Send what waits, then `last`, blocking now (bounded: the server reads to the end)."""
        self._queue(last)
        os.set_blocking(self._fd, True)
        self._drain()


CPU_KERNEL_CACHE = "64"  # oneDNN primitives kept per process (torch's default: 1024)


def bound_cpu_kernel_caches() -> None:
    """Bound the CPU matmul kernels a long-lived engine keeps. On a CPU, torch runs bf16
    matmuls through oneDNN, which builds (JIT-compiles) a kernel per shape and caches it, in
    its own primitive cache and in torch's ideep cache, 1024 of each by default. A serving
    engine meets a new shape at nearly every step (the batch's token count, each sequence's
    context length in attention), so its memory grew burst after burst: 7-10 MB per burst
    of 64 streams on the course model, 470 -> 646 MB over 20 bursts, none of it Python
    objects (tracemalloc: +0.1 MB). With 64 of each it stays flat (measured: 514 MB from the
    5th burst to the 24th). Set before the first matmul; an environment that sets them wins."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", CPU_KERNEL_CACHE)
    os.environ.setdefault("LRU_CACHE_CAPACITY", CPU_KERNEL_CACHE)


def engine_main(commands, turns, model, engine_kwargs: dict, name: str) -> None:
    """The engine process: build the engine, say what it is, run the loop until told to stop
    or until the server goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle
    bound_cpu_kernel_caches()
    import layer5_parallel as l5

    try:
        llm = l5.LLM(model, **engine_kwargs)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which raises it
        turns.send(("error", type(e).__name__, str(e)))
        return
    try:
        tok = llm.model.tokenizer

        def token_text(t: int) -> str:
            return "" if tok is None else tok.decode([t], skip_special_tokens=False)
        _leave_a_core(llm)
        # the model, tokenizer and caches live as long as the process: out of the garbage
        # collector's way, so its full passes during serving only walk what serving allocates
        gc.collect()
        gc.freeze()
        turns.send(("ready", EngineInfo.of(llm)))
        sink = PipeSink(turns)
        loop = EngineLoop(llm, name=name, commands=PipeCommands(commands, token_text),
                          sink=sink, start=False)
        sink.loop = loop
        loop.listeners.append(sink)
        loop.run()
        sink.close(("bye",))
    finally:
        llm.close()


def engine_process_main(*args) -> None:
    """engine_main, then leave at once (os._exit) once the engine is closed: finalizing the
    interpreter would only tear down extension modules, and nanobind-built ones (newer
    Triton's) print "nanobind: leaked ..." reports then, onto the server's terminal."""
    try:
        engine_main(*args)
        code = 0
    except BaseException:  # noqa: BLE001 - shown as multiprocessing would, then exit 1
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream
            stream.flush()
    os._exit(code)


def _leave_a_core(llm) -> None:
    """Torch's CPU threads. On a CPU engine they would take every core, the server's
    included, and spin against it: leave one to the server process. On a GPU engine the
    host side of a step is Python and small tensors, which gain nothing from a thread pool,
    while the pool's threads spin after every parallel region on the cores the server and
    its clients need: one thread (vLLM sets its engine processes the same way). Either
    way OMP_NUM_THREADS, when set, decides."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    if llm.model.device.type == "cpu":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) - 1)))
    else:
        torch.set_num_threads(1)


def _fault(loop: EngineLoop, kind: str, arg: int) -> None:
    if kind == "crash":
        os._exit(arg)
    real, calls = loop.llm.step, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == arg:
            loop.llm.step = real
            raise RuntimeError("injected fault")
        return real(*a, **k)
    loop.llm.step = flaky
