"""Pipeline steps in flight: k groups of sequences take turns, so the stages work at once.

Why a pipelined engine drains: a decode step's inputs are the tokens sampled from the step
before, and those come back from the last stage. So with one step at a time, stage 0 waits
for the last stage to finish step N before it can start step N + 1: every step fills and
drains the pipeline, and micro-batches only overlap *inside* a step (idle share
(p - 1)/(m + p - 1), and each micro-batch reads the stage's weights again).

Steps in flight (`pp_steps_in_flight=k`, vLLM's virtual engines at k = P): the running
sequences are split into k groups ("lanes"), and the engine steps the lanes in turn. A call
of `step()` for lane g
    1. lands lane g's previous step (the oldest in flight): waits for its logits from the
       last stage, samples them, appends the tokens (layer 4's sampling and postprocess);
    2. schedules lane g's sequences (layer 4's scheduler, over that lane only: its running
       sequences, new ones admitted into it, preemption among its own) and dispatches the
       step: the ranks get it, stage 0 computes it and sends it on, and step() returns
       without waiting for its logits.
While lane g's step runs on stage 0, the steps of the other lanes run on the later stages:
the stages pass the lanes along like a bucket brigade, and no group waits for another's
tokens. Every sequence stays in one lane, so its own steps still run one after the other,
each from the tokens of the last: greedy outputs are one process's.

With async scheduling (layer 4's, on by default on a GPU) landing is split around step 2:
lane g's previous step is received and sampled on the device, its tokens start their copy to
the host, lane g is scheduled over them (layer 4's `num_pending`: each decoding sequence's
input token is that step's sample, gathered on the device) and dispatched, and only then are
the tokens read and appended. Why: with k = p, stage 0 finishes the other lanes' steps just
as the last stage sends lane g's tokens back, so every microsecond of host work between their
arrival and the next dispatch (read, postprocess, schedule, inputs, launch) idles stage 0
once a round; now rank 0's stream waits for the tokens, not its host.

What keeps it correct:
- a lane never preempts another lane's sequence (whose step may be in flight): victims come
  from the lane being scheduled, whose step has landed (or, overlapped, is landing: its
  tokens count as layer 4's async scheduling counts them);
- freed blocks may be reused by a later step of another lane while an earlier step still
  writes them: harmless, every rank runs the steps in the order dispatched;
- steps land in the order dispatched (the hand-offs between two ranks are matched in the
  order posted, gloo's per tag and NCCL's per pair): round-robin turns make a lane's own
  step the oldest, and a step that cannot be deferred (several forward passes: long prompts
  on a padding backend) first lands every step in flight and then runs at once;
- the last stage waits for its logits sends only k steps later (engine.StageProgram).

The gain (README, "Steps in flight"): drained, a decode step of PP=p costs about
(m + p - 1)(W/p + KV/(p m)) against one GPU's W + KV; with k = p lanes each GPU's round
costs W + KV/p for p lanes' tokens.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass

import torch

import layer4_algorithms as engine

from .engine import PendingLogits

Seq = engine.Sequence


class LaneScheduler(engine.Scheduler):
    """Layer 4's scheduler over `lanes` groups of sequences: `schedule_lane(g)` runs layer 4's
    schedule() over lane g's running sequences only, with max_num_seqs // lanes seats, and
    puts what it admits into lane g (fork: children into their parent's). The waiting queue,
    the block pool and the prefix cache are shared. A lane admits up to its fair share of the
    live sequences (running and waiting over the lanes; at least what the first waiting
    request needs), so that a few requests spread over the lanes instead of filling one."""

    def __init__(self, block_manager: engine.BlockManager, config, *, lanes: int) -> None:
        super().__init__(block_manager, config, on_release=(self._forget,))
        self.lanes = lanes
        self.seats = self.max_num_seqs // lanes
        self.lane_of: dict[int, int] = {}  # seq_id -> lane, while it holds a row
        # each lane's running sequences; `running` is always all of them, lane after lane
        # (a lane's step reads only its own list: no pass over the others' sequences)
        self.lane_running: list[list[Seq]] = [[] for _ in range(lanes)]

    def add(self, seq: Seq) -> None:
        if seq.params.n > self.seats:
            raise ValueError(f"request {seq.request_id}: n={seq.params.n} parallel samples exceed "
                             f"a lane's {self.seats} seats (max_num_seqs {self.max_num_seqs} over "
                             f"{self.lanes} steps in flight)")
        super().add(seq)

    def schedule_lane(self, lane: int) -> engine.SchedulerOutput:
        waiting = self.waiting
        live = sum([1 + q.pending_forks for q in waiting]) + len(self.running)
        need = 1 + waiting[0].pending_forks if waiting else 1  # (unforked children: a few)
        mine = self.lane_running[lane]
        before = len(mine)
        self.running = mine  # schedule() preempts from it and admits into it, in place
        limit = self.max_num_seqs
        self.max_num_seqs = min(self.seats, max(-(-live // self.lanes), need))
        try:
            out = self.schedule()
        finally:
            self.max_num_seqs = limit
            self.running = list(itertools.chain.from_iterable(self.lane_running))
        admitted = len(mine) - before + len(out.preempted)  # appended at its end
        for q in mine[len(mine) - admitted:]:
            self.lane_of[q.seq_id] = lane
        return out

    def fork(self, parent: engine.ScheduledSeq, children: list[Seq],
             out: engine.SchedulerOutput) -> None:
        super().fork(parent, children, out)
        lane = self.lane_of[parent.seq.seq_id]
        mine = self.lane_running[lane]
        at = mine.index(parent.seq) + 1
        mine[at:at] = children  # right behind their parent, as in `running`
        for child in children:
            self.lane_of[child.seq_id] = lane

    def _finish(self, seq: Seq) -> None:
        if seq.status is engine.SequenceStatus.RUNNING:  # out of its lane's list too
            self.lane_running[self.lane_of[seq.seq_id]].remove(seq)
        super()._finish(seq)

    def _finish_all(self, seqs: list[Seq]) -> None:
        for q in seqs:  # (one at a time: each leaves its lane's list and `running`)
            self._finish(q)

    def _forget(self, seq: Seq) -> None:
        self.lane_of.pop(seq.seq_id, None)


@dataclass
class Flight:
    """A dispatched step: its lane, what was scheduled, its logits (filled when it lands) and
    the forwards whose logits are still to be collected."""

    lane: int
    out: engine.SchedulerOutput
    logits: object  # layer 4's StepLogits
    pending: list[PendingLogits]


class StepsInFlight:
    """For layer 5's LLM: step() and drain() with `pp_steps_in_flight` steps in flight (the
    `lanes` attribute set; else layer 4's). Reads the engine's scheduler (a LaneScheduler),
    runner (its net a PPModel) and layer 4's _sample_launch, _complete and _end_step."""

    lanes: int | None = None  # steps in flight (None: layer 4's step)

    def start_lanes(self, lanes: int) -> None:
        """Called once the engine is built (no request yet): its scheduler becomes lanes'."""
        self.scheduler = LaneScheduler(self.block_manager, self.config, lanes=lanes)
        self.lanes, self._turn, self._flights = lanes, 0, deque()
        device = self.runner.net.device
        self._land_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def step(self, *, unfinished: bool = True, delta: bool = False):
        if self.lanes is None:
            return super().step(unfinished=unfinished, delta=delta)
        start = time.perf_counter()
        advanced: list[engine.SchedulerOutput] = []
        finished: list[Seq] = []
        for _ in range(self.lanes):  # the next lane with work (an idle lane passes its turn)
            lane, self._turn = self._turn, (self._turn + 1) % self.lanes
            prev = None  # the lane's previous step, its tokens still on the device
            while self._flights and any(f.lane == lane for f in self._flights):
                flight = self._flights.popleft()  # (its own: the oldest)
                launched, arrived = self._land_launch(flight, advanced, finished)
                if flight.lane == lane and self._overlaps(launched):
                    prev = (launched, arrived)
                else:
                    self._complete(launched, advanced, finished)
            out = self.scheduler.schedule_lane(lane)
            if out.scheduled:
                self._dispatch(lane, out, advanced, finished, prev)
            if prev is not None:  # read while the stages run the step just dispatched
                self._complete(prev[0], advanced, finished)
            if out.scheduled or advanced:  # (landed with nothing more: the outputs go out now)
                break
        else:  # no lane had a step in flight or one to run
            self._check_progress()  # raises if requests wait and none could run
        return self._end_step(start, advanced, finished, unfinished, delta)

    def _overlaps(self, launched) -> bool:
        """Whether a lane's next step may be dispatched before this landing step's tokens reach
        the host (layer 4's async scheduling, per lane): its tokens stay on the device, where
        the next step's inputs are gathered from; a step of first tokens only is read at once
        (nothing to overlap; its tokens go out sooner), as layer 4 does."""
        return (self.config.async_scheduling and launched.device_tokens is not None
                and not launched.first_only)

    def drain(self):
        if self.lanes is None:
            return super().drain()
        finished: list[Seq] = []
        while self._flights:
            self._land(self._flights.popleft(), [], finished)
        return self._outputs({q.request_id for q in finished}, False, time.perf_counter())

    def _dispatch(self, lane: int, out: engine.SchedulerOutput, advanced: list,
                  finished: list, prev=None) -> None:
        """Send lane's step through the pipeline. Deferred (its logits collected when it lands)
        unless layer 4's runner would run it as several forward passes (their logits are
        joined inside the runner): then every step in flight lands first and it runs now.
        prev: (the lane's previous step, landing, its tokens still on the device; the event of
        their arrival or None): a decoding sequence's input is gathered from them there (layer
        4's runner), rank 0's stream waiting for that event."""
        runner, net = self.runner, self.runner.net
        defer = runner.padded_attention_bytes(out.scheduled) <= runner.attn_bytes_limit
        tokens = None
        if prev is not None:
            tokens, arrived = prev[0].device_tokens, prev[1]
            if arrived is not None:  # landed on the landing stream: rank 0's stream waits
                here = torch.cuda.current_stream(tokens.device)
                here.wait_event(arrived)
                tokens.record_stream(here)  # (made on the landing stream, read on this one)
        if not defer:
            while self._flights:
                self._land(self._flights.popleft(), advanced, finished)
        net.deferred = defer
        try:
            logits = runner.execute(out, tokens)
        finally:
            net.deferred = False
        flight = Flight(lane, out, logits, net.pending)
        net.pending = []
        if defer:
            self._flights.append(flight)
        else:
            self._land(flight, advanced, finished)

    def _land(self, flight: Flight, advanced: list, finished: list) -> None:
        """A step's logits back from the last stage, sampled, its tokens appended."""
        self._complete(self._land_launch(flight, advanced, finished)[0], advanced, finished)

    def _land_launch(self, flight: Flight, advanced: list, finished: list):
        """A step's logits (or greedy ids) received from the last stage and sampled: layer 4's
        LaunchedStep, its tokens on the device and on their way to the host (on the host at
        once when sampling needs it). A deferred step lands on a GPU stream of its own: on
        rank 0's stream its receive and the copy of its tokens would queue behind the stage-0
        work of the step dispatched just before (another lane's), and reading them would wait
        for that too. Returns the step and, landed on that stream, the event a step that takes
        its tokens as inputs waits for (else None)."""
        stream = self._land_stream if flight.pending else None
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for step in flight.pending:
                self.runner.net.collect(step)
            for s in flight.out.scheduled:  # aborted while in flight: its children never come
                if s.seq.status is engine.SequenceStatus.FINISHED:
                    s.seq.pending_forks = 0
            sync = self._host_sampling > 0
            launched, _ = self._sample_launch(flight.out, flight.logits, None, sync, advanced,
                                              finished)
            arrived = stream.record_event() if stream is not None else None
        return launched, arrived
