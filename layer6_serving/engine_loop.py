"""The background thread that owns an engine: the only code that touches it.

Requests and aborts cross from the event loop(s) through a thread-safe command queue; the
thread, each turn:

    drain commands -> expire timed-out requests -> admit by priority -> one engine step
    -> collect each advanced request's deltas -> hand the turn's whole batch to the sink

The sink is where a turn's outputs go, all at once (one message per step, not one per
request): in-process (`LoopSink`), one call_soon_threadsafe per event loop per turn, which
puts each item on its request's asyncio queue; in an engine process (engine_process.py),
one pipe message per turn to the server process.

An abort is applied before the next step, so a client that goes away holds its KV blocks
for at most the step in flight. Admission: the engine orders only the requests it holds, so
priority is applied here too, in front of it: requests wait in a heap (priority, arrival)
and enter the engine only while it has seats free (max_num_seqs), so a high-priority
request overtakes every lower-priority one still waiting here. Each request's priority is
passed down to the engine, whose "priority" scheduling (AsyncEngine(policy="priority")
builds it so) orders its own queue the same way and preempts the lowest priority first.
"""
from __future__ import annotations

import heapq
import itertools
import queue
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
from .streams import RequestMetricsSummary, unpack


class EngineLoop:
    """Owns `llm` in a daemon thread (start=False: the caller runs `run()` itself, as the
    engine process does). priority: order admission by (priority, arrival) instead of
    arrival only. Listeners get on_step(EngineSnapshot) after every turn that did something
    and on_finish(FinishedRequest) per request. sink.flush([(request, item), ...]) gets each
    turn's outputs (default: LoopSink, the requests' own asyncio queues)."""

    def __init__(self, llm, *, priority: bool, name: str, sink=None, start: bool = True) -> None:
        self.llm, self.priority = llm, priority
        self.sink = sink or LoopSink()
        self.packed = getattr(self.sink, "packed", False)  # items as streams.pack makes them
        self._outbox: list[tuple[Request, object]] = []
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.pending: list[tuple[int, int, Request]] = []  # heap: waiting for admission
        self.live: dict[str, Request] = {}  # admitted to the engine
        self.snapshot = EngineSnapshot(kv_blocks_total=llm.block_manager.num_blocks)
        # Requests submitted and not yet admitted or dropped: two counters, each written by
        # one thread only (the submitter's, the engine's), so no lock is needed.
        self._submitted = self._dequeued = 0
        self.listeners: list = []
        self._order = itertools.count()
        self._seen = {"q": 0, "h": 0, "p": 0, "a": 0, "pre": 0}
        self._stop = False
        self.beat = time.monotonic()  # the start of the loop's latest turn
        self.thread = threading.Thread(target=self.run, name=f"engine-{name}", daemon=True)
        if start:
            self.thread.start()

    # ---- from any thread -----------------------------------------------------------------------
    @property
    def num_queued(self) -> int:
        return self._submitted - self._dequeued

    def submit(self, req: Request) -> None:
        self._submitted += 1
        self.commands.put(("add", req))
        self.wake.set()

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id))
        self.wake.set()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    # supervision (engine_process.py restarts a dead process; a thread is not restarted)
    fatal: str | None = None
    restarts = 0
    stall_timeout = 5.0

    @property
    def down_reason(self) -> str | None:
        return None if self.thread.is_alive() else "the engine thread is not running"

    def stalled_for(self) -> float | None:
        """Seconds since the loop's last turn while it has work, past stall_timeout."""
        if not (self.live or self.pending or self.num_queued):
            return None
        idle = time.monotonic() - self.beat
        return idle if idle > self.stall_timeout else None

    def request_stop(self) -> None:
        """End the loop after its current turn (requests still in it get an error)."""
        self._stop = True
        self.wake.set()

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
        for req in list(self.live.values()) + [r for _, _, r in self.pending]:
            self._drop(req, EngineStepError("the server is shutting down"))
        self._flush()

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        self.sink.flush(batch)

    def _turn(self) -> None:
        self.wake.clear()
        self._drain()
        self._expire()
        self._admit()
        if not self.llm.has_unfinished():
            self._publish()
            # hand the idle state over now, not after the wait: the next request would
            # otherwise carry this turn's flush on its way to the engine
            self._flush()
            # output the sink could not hand over yet: come back for it soon
            idle = 0.002 if getattr(self.sink, "backlog", None) else 1.0
            self._wait(0.05 if self.pending or self.live else idle)
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

    def _wait(self, timeout: float) -> None:
        """Idle: until a command arrives (submit, abort and stop set `wake`) or `timeout`."""
        self.wake.wait(timeout)

    def _drain(self) -> None:
        while True:
            try:
                kind, arg = self.commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._queue(arg)
            else:
                self._cancel(arg)

    def _queue(self, req: Request) -> None:
        """A submitted request joins the admission heap."""
        req.order = next(self._order)
        heapq.heappush(self.pending, (req.priority if self.priority else 0, req.order, req))

    def _cancel(self, request_id: str) -> None:
        if request_id in self.live:
            self._abort(self.live[request_id], None)
        else:
            self._remove_pending(request_id)

    def _remove_pending(self, request_id: str) -> None:
        for i, (_, _, r) in enumerate(self.pending):
            if r.request_id == request_id:
                self.pending.pop(i)
                heapq.heapify(self.pending)
                self._dequeued += 1
                return

    def _expire(self) -> None:
        now = time.perf_counter()
        for req in [r for r in self.live.values() if r.deadline is not None and now > r.deadline]:
            self._abort(req, RequestTimeoutError(f"request {req.request_id} timed out"))
        late = [r for _, _, r in self.pending if r.deadline is not None and now > r.deadline]
        for req in late:
            self._remove_pending(req.request_id)
            self._post(req, RequestTimeoutError(f"request {req.request_id} timed out while queued"))

    def _admit(self) -> None:
        sched = self.llm.scheduler
        while self.pending and len(sched.waiting) + len(sched.running) < sched.max_num_seqs:
            _, _, req = heapq.heappop(self.pending)
            self._dequeued += 1
            try:
                self.llm.add_request(req.prompt_ids, req.params, request_id=req.request_id,
                                     priority=req.priority if self.priority else 0)
            except ValueError as e:  # a check the server did not make up front
                self._post(req, e)
                continue
            req.prompt_tokens = len(req.prompt_ids)
            self.snapshot.prompt_tokens += req.prompt_tokens
            self.live[req.request_id] = req

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

    def _drop(self, req: Request, error: Exception) -> None:
        if req.request_id in self.live:
            self._abort(req, error)
        else:
            self._post(req, error)

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
        s.running, s.waiting = len(sched.running), len(sched.waiting) + len(self.pending)
        s.requests = len(self.live) + len(self.pending)
        s.kv_blocks_used = bm.num_blocks - bm.num_free_blocks
        st = llm.stats
        for key, cur, attr in (("q", st.prefix_queried_tokens, "prefix_queried_tokens"),
                               ("h", st.prefix_hit_tokens, "prefix_hit_tokens"),
                               ("p", st.spec_proposed, "spec_proposed"),
                               ("a", st.spec_accepted, "spec_accepted"),
                               ("pre", st.preemptions, "preemptions")):
            setattr(s, attr, getattr(s, attr) + max(0, cur - self._seen[key]))
            self._seen[key] = cur
        if len(st.ttfts) > 10_000:  # the engine keeps per-request lists: bound a long-lived server
            llm.reset_stats()
            self._seen = dict.fromkeys(self._seen, 0)
        for listener in self.listeners:
            listener.on_step(s)


class LoopSink:
    """In-process delivery: per turn, one call_soon_threadsafe per event loop (not one per
    request), which puts every item on its request's asyncio queue."""

    def flush(self, batch: list[tuple[Request, object]]) -> None:
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
