"""The loop that owns an engine: the only code that touches it, in a thread of the server or
in an engine process of its own. The two differ only in transport (loop_transport.py):
where commands come from (a queue the event loop writes, or the pipe from the server) and
where a turn's outputs go (the requests' asyncio queues, or one pipe message per turn).

Each turn:

    take commands (add: into the engine at once; abort) -> expire timed-out requests
    -> one engine step -> collect each advanced request's deltas -> hand the turn's whole
    batch to the sink

Admission and priority are the engine's own (layer 4's scheduler: seats, token budget, and
under scheduling="priority" its waiting queue in (priority, arrival) order); the loop passes
each request's priority down. An abort is applied before the next step, so a client that
goes away holds its KV blocks for at most the step in flight.
"""
from __future__ import annotations

import threading
import time

from .engine_state import (
    EngineSnapshot,
    EngineStepError,
    FinishedRequest,
    Request,
    RequestTimeoutError,
    SamplingError,
)
from .loop_transport import LoopSink, ThreadCommands
from .streams import RequestMetricsSummary, unpack

# the engine's cumulative counters the snapshot adds up (the engine may reset its own)
ENGINE_COUNTERS = ("prefix_queried_tokens", "prefix_hit_tokens", "spec_proposed", "spec_accepted",
                   "preemptions")


class EngineLoop:
    """Owns `llm` in a daemon thread (start=False: the caller runs `run()` itself, as the
    engine process does). commands: where commands come from (default: ThreadCommands, fed
    by submit / abort from any thread); sink.flush([(request, item), ...]) gets each turn's
    outputs (default: LoopSink, the requests' own asyncio queues). Listeners get
    on_step(EngineSnapshot) after every turn that did something and on_finish(FinishedRequest)
    per request. stall_timeout: seconds without a turn, with work, before `stalled_for` says
    so (the server's /health)."""

    def __init__(self, llm, *, name: str, commands=None, sink=None, start: bool = True,
                 stall_timeout: float = 5.0) -> None:
        self.llm, self.stall_timeout = llm, stall_timeout
        self.commands = commands or ThreadCommands()
        self.sink = sink or LoopSink()
        self.packed = getattr(self.sink, "packed", False)  # items as streams.pack makes them
        self._outbox: list[tuple[Request, object]] = []
        self.live: dict[str, Request] = {}  # in the engine
        self.snapshot = EngineSnapshot(kv_blocks_total=llm.block_manager.num_blocks)
        # Requests submitted and not yet taken into the engine: counters each written by one
        # thread only (the submitter's; the engine's, at the same time as the snapshot), so no
        # lock is needed.
        self._submitted = self._taken = self._dequeued = 0
        self.listeners: list = []
        self._engine_counts = dict.fromkeys(ENGINE_COUNTERS, 0)  # as of the last publish
        self._stop = False
        self.beat = time.monotonic()  # the start of the loop's latest turn
        self.thread = threading.Thread(target=self.run, name=f"engine-{name}", daemon=True)
        if start:
            self.thread.start()

    # ---- from any thread -----------------------------------------------------------------------
    @property
    def num_queued(self) -> int:
        """Requests waiting for a seat: on their way to the engine, or in its waiting queue."""
        return self._submitted - self._dequeued + self.snapshot.waiting

    def submit(self, req: Request) -> None:
        self._submitted += 1
        self.commands.send(("add", req))

    def abort(self, request_id: str) -> None:
        self.commands.send(("abort", request_id))

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    # supervision (engine_process.py restarts a dead process; a thread is not restarted)
    fatal: str | None = None
    restarts = 0

    @property
    def down_reason(self) -> str | None:
        return None if self.thread.is_alive() else "the engine thread is not running"

    @property
    def open_requests(self) -> int:
        return len(self.live) + self.num_queued

    def stalled_for(self) -> float | None:
        """Seconds since the loop's last turn while it has work, past stall_timeout."""
        if not (self.live or self.num_queued):
            return None
        idle = time.monotonic() - self.beat
        return idle if idle > self.stall_timeout else None

    def request_stop(self) -> None:
        """End the loop after its current turn (requests still in it get an error)."""
        self._stop = True
        self.commands.wake()

    def stop(self, timeout: float = 10.0) -> None:
        self.request_stop()
        if self.thread.is_alive():
            self.thread.join(timeout)

    # ---- the thread ----------------------------------------------------------------------------
    def run(self) -> None:
        while not self._stop:
            self.beat = time.monotonic()
            try:
                self._turn()
            except Exception as e:  # noqa: BLE001 - a bug here must not leave clients waiting
                self._fail_all(EngineStepError(f"engine loop failed: {type(e).__name__}: {e}"))
                time.sleep(0.01)  # should it fail again at once, do not spin
            self._flush()
        for req in list(self.live.values()):
            self._abort(req, EngineStepError("the server is shutting down"))
        self._flush()

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        self.sink.flush(batch)

    def _turn(self) -> None:
        self._drain()
        self._expire()
        if not self.llm.has_unfinished():
            self._publish()
            # hand the idle state over now, not after the wait: the next request would
            # otherwise carry this turn's flush on its way to the engine
            self._flush()
            # output the sink could not hand over yet: come back for it soon
            idle = 0.002 if getattr(self.sink, "backlog", None) else 1.0
            self.commands.wait(self, 0.05 if self.live else idle)
            return
        try:
            outs = self.llm.step(delta=True)  # only the new tokens: no copy of whole outputs
        except Exception as e:  # noqa: BLE001 - reported to every request, the loop lives on
            self._fail_all(EngineStepError(f"engine step failed: {type(e).__name__}: {e}"))
            return
        self.snapshot.steps += 1
        self._publish()  # before delivering: a client that sees its tokens sees this state
        for o in outs:
            self._deliver(o)

    def _drain(self) -> None:
        for kind, arg in self.commands.receive(self):
            if kind == "add":
                self._add(arg)
            elif arg in self.live:  # abort
                self._abort(self.live[arg], None)

    def _add(self, req: Request) -> None:
        """Into the engine at once: its scheduler admits by seats, budget and priority."""
        self._taken += 1
        try:
            self.llm.add_request(req.prompt_ids, req.params, request_id=req.request_id,
                                 priority=req.priority)
        except ValueError as e:  # a check the server did not make up front
            self._post(req, e)
            return
        req.prompt_tokens = len(req.prompt_ids)
        self.snapshot.prompt_tokens += req.prompt_tokens
        self.live[req.request_id] = req

    def _expire(self) -> None:
        now = time.perf_counter()
        for req in [r for r in self.live.values() if r.deadline is not None and now > r.deadline]:
            self._abort(req, RequestTimeoutError(f"request {req.request_id} timed out"))

    def _deliver(self, out) -> None:
        req = self.live.get(out.request_id)
        if req is None:
            return
        deltas, new = req.tracker.packed(out.outputs)
        if new:
            now = time.perf_counter()
            if req.last_token_time is not None:
                req.itls.append(now - req.last_token_time)
            req.last_token_time = now
            req.completion_tokens += new
            self.snapshot.generation_tokens += new
        # a request sampling could not draw (nan / inf probabilities) ends with its own error
        failed = out.finished and any(c.finish_reason == "error" for c in out.outputs)
        if deltas or (out.finished and not failed):
            done = out.finished and not failed
            item = (req.request_id, deltas, done, req.prompt_tokens,
                    req.completion_tokens, self._summary(req, out) if done else None)
            # packed as it goes down a pipe (streams.pack's form) when the sink sends it on
            self._post(req, item if self.packed else unpack(item))
        if failed:
            self._post(req, SamplingError(
                f"request {req.request_id}: sampling failed (its probabilities were not finite: "
                f"the model produced nan / inf for it); the other requests were not affected"))
        if out.finished:
            self._close(req, out.metrics, out.outputs[0].finish_reason)

    def _summary(self, req: Request, out) -> RequestMetricsSummary:
        m = out.metrics
        tps = None
        if m.tpot:
            tps = 1.0 / m.tpot
        return RequestMetricsSummary(ttft_s=m.ttft, tokens_per_s=tps,
                                     cached_prompt_tokens=m.num_cached_tokens,
                                     spec_acceptance=m.spec_acceptance,  # this request's own
                                     e2e_s=m.latency, queue_s=m.queue_time)

    def _abort(self, req: Request, error: Exception | None) -> None:
        out = self.llm.abort(req.request_id)  # frees its KV blocks now
        if error is not None:
            self._post(req, error)
        self._close(req, out.metrics if out else None, "abort")

    def _close(self, req: Request, metrics, reason: str | None) -> None:
        self.live.pop(req.request_id, None)
        done = FinishedRequest(ttft_s=metrics.ttft if metrics else None,
                               e2e_s=time.perf_counter() - req.arrival,
                               queue_s=metrics.queue_time if metrics else None, itls=req.itls,
                               prompt_tokens=req.prompt_tokens,
                               completion_tokens=req.completion_tokens, finish_reason=reason)
        for listener in self.listeners:
            listener.on_finish(done)

    def _fail_all(self, error: Exception) -> None:
        for req in list(self.live.values()):
            try:
                self._abort(req, error)
            except Exception:  # noqa: BLE001 - the engine is already broken: drop our side
                self.live.pop(req.request_id, None)
                self._post(req, error)
        try:
            self._publish()
        except Exception:  # noqa: BLE001 - the next turn publishes again
            pass

    def _post(self, req: Request, item) -> None:
        self._outbox.append((req, item))

    def _publish(self) -> None:
        """Refresh the snapshot from the engine and tell the listeners."""
        llm, s = self.llm, self.snapshot
        sched, bm = llm.scheduler, llm.block_manager
        s.running, s.waiting, s.requests = len(sched.running), len(sched.waiting), len(self.live)
        self._dequeued = self._taken  # with the waiting count that now includes them
        s.kv_blocks_used = bm.num_blocks - bm.num_free_blocks
        st = llm.stats
        for counter in ENGINE_COUNTERS:  # the engine's totals since its reset -> our increments
            total = getattr(st, counter)
            setattr(s, counter, getattr(s, counter) + max(0, total - self._engine_counts[counter]))
            self._engine_counts[counter] = total
        if len(st.ttfts) > 10_000:  # the engine keeps per-request lists: bound a long-lived server
            llm.reset_stats()
            self._engine_counts = dict.fromkeys(ENGINE_COUNTERS, 0)
        for listener in self.listeners:
            listener.on_step(s)
