"""The engine in its own process: vLLM's AsyncLLM / EngineCore split.

    AsyncEngine("course", engine_process=True)     # stack serve does this by default

Why: an engine step is mostly Python on the host (scheduling, sampling, detokenizing 64
sequences), and so is serving them (asyncio, JSON, SSE, HTTP). In one process they share
one GIL, and each step waits for the HTTP work of the step before: measured, the server
reached a third of the offline engine's throughput. In two processes they overlap.

    server process                                 engine process (spawned)
    AsyncEngine.generate -> ("add", id, ids, ...) --pipe-->  EngineLoop (engine_loop.py, the
    RequestStream.aclose -> ("abort", id)        --pipe-->   same loop as in-process; only
                                                             its transport differs):
    reader thread <-- ("step", items, snapshot, finished, dequeued) -- one message per turn
      -> one call_soon_threadsafe per event loop puts each item on its request's queue

The engine process builds layer 5's LLM itself (tensor_parallel_size > 1: its TP workers
are its own children), sends the facts the server checks requests against (EngineInfo,
with the tokenizer), then runs the loop. It dies with the server: it stops on "stop", and
on end-of-file on the pipe (the server exited, even by SIGKILL); it ignores Ctrl-C (the
server stops it).

The engine process's side is engine_worker.py; supervision (stalls, restarts) is
engine_supervision.py.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import threading
import time
import weakref

from .engine_state import EngineInfo, EngineSnapshot, EngineStepError, Request
from .engine_supervision import Supervised
from .engine_worker import engine_process_main
from .loop_transport import deliver
from .streams import unpack

log = logging.getLogger("layer6_serving")
ERRORS = {e.__name__: e for e in (ValueError, TypeError, FileNotFoundError, OSError)}


class EngineProcess(Supervised):
    """The server side of an engine process; the same surface as EngineLoop (submit, abort,
    stop, snapshot, listeners, num_queued) plus `info` and `alive`. model / engine_kwargs:
    what layer 5's LLM is built from, in the engine process."""

    def __init__(self, model, engine_kwargs: dict, *, name: str,
                 start_timeout: float = 900.0, stall_timeout: float = 5.0,
                 max_restarts: int = 3) -> None:
        self.name = name
        self._args = (model, engine_kwargs, name)
        self.start_timeout, self.stall_timeout = start_timeout, stall_timeout
        self.max_restarts = max_restarts
        self.listeners: list = []
        self.snapshot = EngineSnapshot()
        self._requests: dict[str, Request] = {}  # open requests: their loop and queue
        self._lock = threading.Lock()  # sends come from any thread
        self._submitted = self._dequeued = 0
        self._error: EngineStepError | None = None
        self._closed = False
        self.restarts = 0  # successful restarts
        self.fatal: str | None = None  # restarts kept failing: the server should exit
        self._deaths: list[float] = []
        self._beat = self._busy_since = time.monotonic()
        try:
            self._spawn()
            self.info: EngineInfo = self._handshake(start_timeout)
        except BaseException:
            self._closed = True
            self._end_process(5.0)
            raise
        self.snapshot = EngineSnapshot(kv_blocks_total=self.info.num_blocks)
        self.thread = threading.Thread(target=self._supervise, name=f"engine-{name}-reader",
                                       daemon=True)
        self.thread.start()
        atexit.register(_stop_ref, weakref.ref(self))

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        # Two one-way pipes: commands down, turns up (the engine writes without blocking).
        commands, conn = ctx.Pipe(duplex=False)
        self.outputs, turns = ctx.Pipe(duplex=False)
        with self._lock:
            old, self.conn = getattr(self, "conn", None), conn
        if old is not None:
            old.close()
        # Not a daemon: a daemon may not start processes, and TP workers are its children.
        self.proc = ctx.Process(target=engine_process_main, name=f"engine-{self.name}",
                                daemon=False, args=(commands, turns, *self._args))
        self.proc.start()
        commands.close()
        turns.close()

    def _handshake(self, timeout: float) -> EngineInfo:
        deadline = time.monotonic() + timeout
        while not self.outputs.poll(0.1):
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine process for {self.name!r} exited with code "
                                   f"{self.proc.exitcode} while loading the model (see its "
                                   f"output above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine process for {self.name!r} did not load the "
                                   f"model within {timeout:.0f} s")
        try:
            msg = self.outputs.recv()
        except (EOFError, OSError) as e:
            raise RuntimeError(f"the engine process for {self.name!r} died while loading "
                               f"(exit code {self.proc.exitcode})") from e
        if msg[0] == "error":
            _, kind, message = msg
            raise ERRORS.get(kind, RuntimeError)(
                message if kind in ERRORS else f"{kind}: {message}")
        return msg[1]

    # ---- from any thread -----------------------------------------------------------------------
    @property
    def num_queued(self) -> int:
        """Requests waiting for a seat: on their way to the engine, or in its waiting queue."""
        return self._submitted - self._dequeued + self.snapshot.waiting

    @property
    def alive(self) -> bool:
        return self._error is None and not self._closed and self.proc.is_alive()

    def submit(self, req: Request) -> None:
        if self._error is not None:
            raise self._error
        timeout = None if req.deadline is None else max(0.0, req.deadline - time.perf_counter())
        if not self._requests:  # work after idle: the stall clock starts now
            self._busy_since = time.monotonic()
        self._requests[req.request_id] = req
        with self._lock:
            self._submitted += 1
        try:
            self._send(("add", req.request_id, req.prompt_ids, req.params, req.priority, timeout))
        except EngineStepError:
            self._requests.pop(req.request_id, None)
            raise

    def abort(self, request_id: str) -> None:
        self._requests.pop(request_id, None)  # the engine posts nothing more for it
        try:
            self._send(("abort", request_id))
        except EngineStepError:
            pass  # a dead engine holds no blocks

    def _inject(self, kind: str, arg: int) -> None:
        """Tests only: ("step", n) fails the n-th next step; ("crash", code) ends the engine
        process at once with that exit code."""
        self._send(("fault", kind, arg))

    def _send(self, msg) -> None:
        try:
            with self._lock:
                self.conn.send(msg)
        except (OSError, ValueError) as e:  # a closed or broken pipe
            raise self._error or EngineStepError(
                f"the engine process of {self.name!r} is not running") from e

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine process (its open requests get an error) and wait for it."""
        if self._closed:
            return
        self._closed = True
        try:
            self._send(("stop",))
        except EngineStepError:
            pass
        self._end_process(timeout)
        self.thread.join(5.0)
        self._fail_all(EngineStepError("the server is shutting down"))
        self.conn.close()
        self.outputs.close()

    def _end_process(self, timeout: float) -> None:
        if getattr(self, "proc", None) is None or self.proc.pid is None:  # never started
            return
        self.proc.join(timeout)
        for end in (self.proc.terminate, self.proc.kill):
            if self.proc.is_alive():
                end()
                self.proc.join(5.0)

    # ---- the reader thread (its loop, with restarts: engine_supervision.py) ---------------------
    def _read(self) -> None:
        try:
            while True:
                msg = self.outputs.recv()
                if msg[0] == "bye":
                    break
                self._beat = time.monotonic()
                self._on_step(*msg[1:])
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001 - a bug here must not leave clients waiting
            log.exception("engine %r: reading the engine process failed", self.name)
        if not self._closed:
            self.proc.join(1.0)
            if self.proc.is_alive():  # the pipe broke but the process lives: end it
                self._end_process(1.0)

    def _on_step(self, items, snapshot, finished, dequeued: int) -> None:
        self._dequeued = dequeued
        if snapshot is not None:
            self.snapshot = snapshot
        for listener in self.listeners:  # metrics first: a client that sees its end sees them
            for done in finished:
                listener.on_finish(done)
            if snapshot is not None:
                listener.on_step(snapshot)
        batch = []
        for rid, item in items:
            req = self._requests.get(rid)
            if req is None:
                continue  # aborted here already
            if not isinstance(item, BaseException):
                item = unpack(item)
            if isinstance(item, BaseException) or item.finished:
                self._requests.pop(rid, None)
            batch.append((req, item))
        deliver(batch)

    def _fail_all(self, error: Exception) -> None:
        reqs, self._requests = self._requests, {}
        deliver((req, error) for req in reqs.values())


def _stop_ref(ref) -> None:
    engine = ref()
    if engine is not None:
        engine.stop()
