"""The engine in its own process: vLLM's AsyncLLM / EngineCore split.

    AsyncEngine("course", engine_process=True)     # stack serve does this by default

Why: an engine step is mostly Python on the host (scheduling, sampling, detokenizing 64
sequences), and so is serving them (asyncio, JSON, SSE, HTTP). In one process they share
one GIL, and each step waits for the HTTP work of the step before: measured, the server
reached a third of the offline engine's throughput. In two processes they overlap.

    server process                                 engine process (spawned)
    AsyncEngine.generate -> ("add", id, ids, ...) --pipe-->  EngineLoop (engine_loop.py,
    RequestStream.aclose -> ("abort", id)        --pipe-->   the same code as in-process):
    reader thread <-- ("step", items, snapshot, finished, dequeued) -- one message per turn
      -> one call_soon_threadsafe per event loop puts each item on its request's queue

The engine process builds layer 5's LLM itself (tensor_parallel_size > 1: its TP workers
are its own children), sends the facts the server checks requests against (EngineInfo,
with the tokenizer), then runs the loop. It dies with the server: it stops on "stop", and
on end-of-file on the pipe (the server exited, even by SIGKILL); it ignores Ctrl-C (the
server stops it).

Supervision (the server side watches the engine): every turn that does something sends a
message, so a process with open requests that sends nothing for `stall_timeout` seconds is
stalled (stopped, deadlocked, swapping): `stalled_for()` says so and /health turns 503 with
the reason. A process that dies fails its open requests with EngineUnavailable (clear, and
retryable: 503), and is restarted with the same arguments; requests sent meanwhile get 503.
Restarts that keep failing (`max_restarts` failed starts in a row, or that many deaths
within a minute) make the engine fatal: `fatal` holds the reason and `stack serve` exits
non-zero with it.
"""
from __future__ import annotations

import atexit
import copy
import gc
import logging
import multiprocessing as mp
import os
import pickle
import signal
import struct
import sys
import threading
import time
import traceback
import weakref

from .engine_loop import EngineLoop, deliver
from .engine_state import EngineInfo, EngineSnapshot, EngineStepError, EngineUnavailable, Request
from .streams import DeltaTracker, unpack

log = logging.getLogger("layer6_serving")
ERRORS = {e.__name__: e for e in (ValueError, TypeError, FileNotFoundError, OSError)}


class EngineProcess:
    """The server side of an engine process; the same surface as EngineLoop (submit, abort,
    stop, snapshot, listeners, num_queued) plus `info` and `alive`. model / engine_kwargs:
    what layer 5's LLM is built from, in the engine process."""

    def __init__(self, model, engine_kwargs: dict, *, priority: bool, name: str,
                 start_timeout: float = 900.0, stall_timeout: float = 5.0,
                 max_restarts: int = 3) -> None:
        self.name = name
        self._args = (model, engine_kwargs, priority, name)
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
        return self._submitted - self._dequeued

    @property
    def alive(self) -> bool:
        return self._error is None and not self._closed and self.proc.is_alive()

    @property
    def down_reason(self) -> str | None:
        """Why the engine does not serve now (None: it does)."""
        if self.fatal:
            return self.fatal
        if self._error is not None:
            return str(self._error)
        if self._closed:
            return "the engine was stopped"
        if not self.proc.is_alive():
            return f"the engine process exited (code {self.proc.exitcode})"
        return None

    def stalled_for(self) -> float | None:
        """Seconds without a turn from the engine while requests are open, once that passes
        stall_timeout (None: not stalled)."""
        if not self._requests:
            return None
        idle = time.monotonic() - max(self._beat, self._busy_since)
        return idle if idle > self.stall_timeout else None

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

    # ---- the reader thread ---------------------------------------------------------------------
    def _supervise(self) -> None:
        """The reader thread: read the engine's turns; when the process dies, fail its open
        requests and start a new one (or give up: `fatal`)."""
        while True:
            self._read()
            if self._closed:
                break
            code = self.proc.exitcode
            self._error = EngineUnavailable(
                f"the engine process of {self.name!r} died (exit code {code}); requests it was "
                f"running are lost; it is being restarted: retry shortly")
            log.error("%s", self._error)
            self._fail_all(self._error)
            self._notify("on_engine_down")
            if not self._restart():
                self._fail_all(self._error)
                break
        self._fail_all(self._error or EngineStepError("the server is shutting down"))

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

    def _restart(self) -> bool:
        """Start a new engine process; False (and `fatal` set) when that keeps failing."""
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < 60.0] + [now]
        if len(self._deaths) > self.max_restarts:
            self.fatal = (f"the engine process of {self.name!r} died {len(self._deaths)} times "
                          f"within a minute: giving up")
        failures = 0
        while self.fatal is None and not self._closed:
            try:
                self.outputs.close()
                self._spawn()
                self._handshake(self.start_timeout)
                if self._closed:  # stopped while it started
                    self._end_process(5.0)
                    return False
            except Exception as e:  # noqa: BLE001 - counted; the last one is reported
                failures += 1
                self._end_process(5.0)
                log.error("engine %r: restart %d failed: %s", self.name, failures, e)
                if failures >= self.max_restarts:
                    self.fatal = (f"the engine process of {self.name!r} could not be restarted "
                                  f"({failures} attempts; last: {e})")
                else:
                    time.sleep(min(2.0 ** failures, 10.0))
                continue
            with self._lock:
                self._submitted = self._dequeued = 0
            self.snapshot = EngineSnapshot(kv_blocks_total=self.info.num_blocks)
            self._beat = time.monotonic()
            self.restarts += 1
            self._error = None
            log.warning("engine %r: restarted (%d restarts)", self.name, self.restarts)
            self._notify("on_engine_up")
            return True
        if self.fatal:
            log.error("%s", self.fatal)
            self._error = EngineUnavailable(self.fatal)
        return False

    def _notify(self, event: str) -> None:
        for listener in self.listeners:
            hook = getattr(listener, event, None)
            if hook is not None:
                hook()

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


# ---- the engine process --------------------------------------------------------------------------
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


def engine_main(commands, turns, model, engine_kwargs: dict, priority: bool, name: str) -> None:
    """The engine process: build the engine, say what it is, run the loop until told to stop
    or until the server goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle
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
        loop = PipeLoop(llm, commands, token_text, priority=priority, name=name, sink=sink)
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
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
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


class PipeLoop(EngineLoop):
    """The engine process's loop: its commands (add, abort, stop, fault) come down the pipe
    and this loop's own thread reads them, between steps and, when idle, by waiting on the
    pipe itself. No reader thread hands them over: that cost a GIL handoff and an Event
    wake-up per request (an add reaching an idle engine now starts its prefill at once) and
    took the GIL from the stepping thread whenever a command came in mid-step. End of file
    on the pipe (the server exited, even by SIGKILL) stops the loop."""

    def __init__(self, llm, conn, token_text, **kwargs) -> None:
        super().__init__(llm, start=False, **kwargs)
        self.conn, self.token_text = conn, token_text

    def _wait(self, timeout: float) -> None:
        try:
            self.conn.poll(timeout)  # wakes as soon as a command (or end of file) arrives
        except (OSError, ValueError):
            self.request_stop()

    def _drain(self) -> None:
        conn = self.conn
        try:
            while not self._stop and conn.poll(0):
                self._command(conn.recv())
        except (EOFError, OSError, ValueError):  # the server exited: stop with it
            self.request_stop()
        super()._drain()

    def _command(self, msg) -> None:
        kind = msg[0]
        if kind == "add":
            _, rid, ids, params, priority, timeout = msg
            deadline = None if timeout is None else time.perf_counter() + timeout
            self._submitted += 1
            self._queue(Request(rid, ids, params, priority, deadline, None, None,
                                DeltaTracker(self.token_text)))
        elif kind == "abort":
            self._cancel(msg[1])
        elif kind == "fault":
            _fault(self, msg[1], msg[2])
        elif kind == "stop":
            self.request_stop()


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
