"""A step on its way: what was scheduled, who samples, and where its tokens are.

Async scheduling (config.async_scheduling; SGLang's overlap scheduler, vLLM's async
scheduling): a step launches its GPU work and returns without waiting for its tokens. The
next `step()` schedules and launches step N+1 first, while the GPU still runs step N (a
decoding sequence's input is step N's sampled token, gathered on the device), and only then
reads step N's tokens (one host sync, behind work already queued), appends them, checks
stops and builds outputs. A sequence that finishes at step N has been scheduled for step
N+1 too: that token is discarded (its KV slot was its own; the blocks are freed at once,
and the GPU runs steps in order, so nobody reuses them before that write). One whose step-N
token reaches max_tokens is not scheduled again. Greedy outputs are the synchronous engine's.

A step that only samples first tokens (prefills reaching their prompt's end, no decode to
overlap) is read by the next call *before* it schedules anything, and that call returns at
once: the first tokens go out without waiting for another step's launch (at low load that
launch was pure time-to-first-token); the call after it launches with the tokens on the host.
Except where the next step is those sequences' first decode and the prefill still runs on
the GPU (nobody waiting to be admitted, `on_gpu()`): then the same call launches that decode
at once, behind the prefill, and reads the first tokens while it runs (engine.py), so the
GPU does not idle between the two while the host reads, appends and schedules.

`LaunchedStep.on_host` holds tokens sampled synchronously (penalties, logprobs and
speculation take that path); `LaunchedStep.on_device` starts their copy to pinned host
memory behind the step's kernels; `read()` waits for them (one host sync) and returns
seq_id -> tokens; `void_rows()` ends the sequences whose row could not be sampled.
The pinned buffer and the event of a step come from a small pool and go back to it once the
step is read (allocating pinned memory and creating an event every step cost the host more
than the copy itself); a step never read just lets them go.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cuda_events import record
from .scheduler import SchedulerOutput
from .sequence import Sequence


@dataclass
class LaunchedStep:
    """`who` sample in row order. `sampled` (seq_id -> tokens) when read synchronously, else
    `tokens` (a pinned host copy of `device_tokens` in flight until `event`; on a CPU the
    tensor itself). `bad` (len(who),) bool: rows sampling could not draw (sampling_guard.py)."""

    out: SchedulerOutput
    who: list[Sequence]
    sampled: dict[int, list[int]] | None = None
    device_tokens: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    first_only: bool = False  # only first tokens sampled: the next step() reads it first
    bad: torch.Tensor | None = None
    _tokens_read: list[int] | None = None  # read_tokens()'s list, once read

    @classmethod
    def on_host(cls, out: SchedulerOutput, who: list[Sequence], tokens: list[int],
                bad: torch.Tensor | None) -> LaunchedStep:
        sampled = {q.seq_id: [t] for q, t in zip(who, tokens, strict=True)}
        return cls(out, who, sampled=sampled, bad=bad)

    @classmethod
    def on_device(cls, out: SchedulerOutput, who: list[Sequence], tokens: torch.Tensor,
                  bad: torch.Tensor | None) -> LaunchedStep:
        """Tokens left on the device; on a GPU their copy back starts now, without waiting.
        Each sequence counts the token in flight (num_pending) and its row (pending_index),
        which is where the next step's runner finds its input."""
        step = cls(out, who, device_tokens=tokens, tokens=tokens, bad=bad)
        # every sampled row is a first token (no sequence here is decoding)
        step.first_only = bool(who) and all(q.num_tokens == q.num_prompt_tokens for q in who)
        if tokens.device.type == "cuda":  # back to pinned memory behind the step's kernels
            step.tokens, step.event = _TOKENS.copy(tokens)
            if bad is not None:  # with the tokens, behind the same event (recorded after)
                step.bad = _pinned_copy(bad)
            record(step.event)
        for j, q in enumerate(who):
            q.num_pending += 1
            q.pending_index = j
        return step

    def on_gpu(self) -> bool:
        """True while the GPU has not reached the end of this step's tokens (their copy
        back to the host included); False once they are there, or when nothing is copied
        (a CPU's tokens, host sampling)."""
        return self.event is not None and not self.event.query()

    def read(self) -> dict[int, list[int]]:
        """seq_id -> the tokens to append (waiting for them if still on the GPU); read once,
        then kept (a step with grammar rows reads its predecessor's tokens early)."""
        if self.sampled is None:
            self.read_tokens()  # (None if read before: its list is kept)
            self.sampled = {q.seq_id: [t] for q, t in zip(self.who, self._tokens_read,
                                                           strict=True)}
        return self.sampled

    def read_tokens(self) -> list[int] | None:
        """The tokens of `who`, one each, in its order (waiting for them if still on the
        GPU), without making `sampled` (a dict of one-token lists): the engine appends them in
        row order when its rows are its scheduled sequences'. None when already read
        (`read()` then has them)."""
        if self.sampled is not None or self._tokens_read is not None:
            return None
        if self.event is not None:
            self.event.synchronize()
        tokens, who = self.tokens.tolist(), self.who
        if self.event is not None:  # the buffer and event serve a later step now
            _TOKENS.give_back(self.tokens, self.event, self.device_tokens.device)
            self.tokens = self.event = None
        if len(tokens) != len(who):
            raise ValueError(f"{len(tokens)} tokens for {len(who)} sampled rows")
        for q in who:
            q.num_pending -= 1
        self._tokens_read = tokens
        return tokens

    def void_rows(self, sampled: dict[int, list[int]]) -> set[str]:
        """Sequences whose row could not be sampled get no token and finish with reason
        "error" (the scheduler's postprocess frees them). Returns their request ids."""
        if self.bad is None:
            return set()
        void = set()
        for q, bad in zip(self.who, self.bad.tolist(), strict=True):
            if bad and q.finish_reason is None:
                sampled.pop(q.seq_id, None)
                q.finish_reason = "error"
                void.add(q.request_id)
        return void


class _PinnedPool:
    """Pinned (>= 256,) int64 buffers, each with its CUDA event, per device, each lent to one
    launched step at a time: copy(tokens) takes a free one (or makes one) and starts the copy
    of (N,) int64 tokens into it (the caller records the event behind it); give_back() once
    the host has read it. At most `keep` are kept per device. (Engines on several threads
    share it: list.pop and append are atomic.)"""

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep
        self.free: dict[torch.device, list] = {}  # device -> [(buffer, event)]

    def copy(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        n, free = tokens.shape[0], self.free.setdefault(tokens.device, [])
        try:
            buf, event = free.pop()
        except IndexError:
            buf = None
        if buf is None or buf.shape[0] < n:  # none free, or too short for this step: a new one
            buf, event = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=True), \
                torch.cuda.Event()
        host = buf[:n]
        host.copy_(tokens, non_blocking=True)
        return host, event

    def give_back(self, host: torch.Tensor, event: torch.cuda.Event, device) -> None:
        free = self.free.setdefault(device, [])
        if len(free) < self.keep:
            free.append((host._base if host._base is not None else host, event))


_TOKENS = _PinnedPool()


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
