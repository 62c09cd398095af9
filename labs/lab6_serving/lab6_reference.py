"""Lab 6's answer key: what plain `pytest` grades (tests/labs/test_lab6.py's REFERENCE) and
what `lab6.ipynb` runs with LLM_STACK_LAB_REFERENCE=1. A submission that imports it earns
nothing. Each answer is a simplified twin of a part the server runs; what it leaves out, and
where the real one is:

- `safe_length`: the hold-back rule on a whole string. The real one is layer 3's
  `FinishRule` (incremental, token by token, with half UTF-8 characters held back too).
- `sse_frames`: OpenAI's SSE framing over a plain iterable of dicts. The real one is
  `layer6_serving/api/sse.py`'s `events` (async, over a request's stream, chunks rendered by
  `api/render.py`, the request aborted when the client leaves).
- `admit`: one admission step over plain records. The real one is layer 4's
  `Scheduler._admit` (sequences with KV blocks: free blocks and prefix-cache hits decide too,
  and preemption, and the static baseline policy).
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

DONE = b"data: [DONE]\n\n"


# ---- Exercise 1: the hold-back rule --------------------------------------------------------
def safe_length(text: str, stops: Sequence[str]) -> int:
    """How many leading characters of a running completion's `text` may be sent now: all
    but the longest end of `text` that is a proper beginning of some stop string (it may
    still grow into that stop string, which must never reach the client)."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return len(text) - hold


# ---- Exercise 2: server-sent events as OpenAI frames them -----------------------------------
def sse_frames(items: Iterable[dict | BaseException]) -> Iterator[bytes]:
    """Frame a stream: each dict as `data: <json>\\n\\n` (JSON on one line); an exception
    ends the stream with one error event in OpenAI's shape {"error": {"message", "type":
    "server_error", "param": None, "code": None}}; `data: [DONE]\\n\\n` always comes last."""
    try:
        for item in items:
            if isinstance(item, BaseException):
                raise item
            yield b"data: " + json.dumps(item, separators=(",", ":")).encode() + b"\n\n"
    except Exception as e:  # noqa: BLE001 - every failure reaches the client as an event
        err = {"error": {"message": str(e), "type": "server_error", "param": None, "code": None}}
        yield b"data: " + json.dumps(err, separators=(",", ":")).encode() + b"\n\n"
    yield DONE


# ---- Exercise 3: one admission step under a token budget ------------------------------------
@dataclass(frozen=True)
class Pending:
    """A request waiting for admission: its id, prompt length, priority (lower runs first
    under the "priority" policy) and arrival order."""

    request_id: int
    prompt_len: int
    priority: int = 0
    arrival: int = 0


def admit(waiting: Sequence[Pending], *, num_running: int, max_num_seqs: int,
          token_budget: int, policy: str = "fcfs") -> list[tuple[int, int]]:
    """One step's admissions: the running sequences decode first (one token each from the
    budget); then waiting requests, in arrival order ("fcfs") or by (priority, arrival)
    ("priority"), each taking min(prompt_len, budget left) prompt tokens (chunked prefill:
    the last one admitted may get only part of its prompt), while seats (max_num_seqs) and
    budget remain. Returns [(request_id, prompt tokens this step)] in admission order."""
    if policy not in ("fcfs", "priority"):
        raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
    key = (lambda p: p.arrival) if policy == "fcfs" else (lambda p: (p.priority, p.arrival))
    budget, seats, out = token_budget - min(num_running, token_budget), num_running, []
    for p in sorted(waiting, key=key):
        if budget <= 0 or seats >= max_num_seqs:
            break
        take = min(p.prompt_len, budget)
        out.append((p.request_id, take))
        budget -= take
        seats += 1
    return out
