"""Lab 6 — serving: your answers.

Three exercises, in the order `lab6.ipynb` teaches them:

1. `safe_length` — what a stream may show: a running completion's text minus the longest
   end that could still grow into a stop string (which must never reach the client).
2. `sse_frames` — server-sent events as OpenAI frames them: `data: <json>\\n\\n` per chunk,
   an error event if the stream fails, `data: [DONE]\\n\\n` last.
3. `admit` — one admission step of a token-budget scheduler: running decodes first, then
   waiting requests by arrival ("fcfs") or by (priority, arrival) ("priority"), with chunked
   prefill, a seat cap and the budget.

Write the code where it says YOUR CODE (each raises NotImplementedError until you do). Keep
the names, signatures and the `Pending` class: the grader uses them. Grade yourself with
`stack grade --lab 6`. Do not import `layer6_serving` (it holds the answers; the grader
refuses a file that imports it). Plain Python and the `json` module are all you need.
"""
from __future__ import annotations

import json  # noqa: F401 - you will want json.dumps
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

DONE = b"data: [DONE]\n\n"


# ---- Exercise 1: the hold-back rule --------------------------------------------------------
def safe_length(text: str, stops: Sequence[str]) -> int:
    """How many leading characters of a running completion's `text` may be sent now: all
    but the longest end of `text` that is a proper beginning of some stop string.

    safe_length("Hello wor", ["world"]) == 6    ("wor" may become "world": hold it)
    safe_length("Hello", ["world"]) == 5        (nothing to hold)
    """
    # YOUR CODE
    raise NotImplementedError("exercise 1: safe_length")


# ---- Exercise 2: server-sent events as OpenAI frames them -----------------------------------
def sse_frames(items: Iterable[dict | BaseException]) -> Iterator[bytes]:
    """Yield the bytes of a stream: each dict as b"data: " + its JSON on one line + b"\\n\\n".
    An item that is an exception (or an exception raised while iterating `items`) ends the
    stream with one error event: {"error": {"message": str(exc), "type": "server_error",
    "param": None, "code": None}}. DONE always comes last, after an error too."""
    # YOUR CODE
    raise NotImplementedError("exercise 2: sse_frames")


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
    """One step's admissions. The num_running running sequences decode first: one token
    each from token_budget. Then waiting requests, in arrival order ("fcfs") or by
    (priority, arrival) ("priority"), each taking min(prompt_len, budget left) prompt tokens
    (the last one admitted may get only part of its prompt: chunked prefill), while the
    budget is above 0 and running + admitted < max_num_seqs. Returns [(request_id, tokens)]
    in admission order. ValueError for another policy."""
    # YOUR CODE
    raise NotImplementedError("exercise 3: admit")
