"""The knobs that trade latency, bandwidth and safety in the send/recv collectives.

Three decisions every collective here makes, with a default per backend:

- **pieces** (pipelining). A ring segment is cut into pieces of about ``chunk_bytes``
  (at most ``max_pieces``), so piece c+1 is on the wire while piece c is being added.
  More pieces hide more of the arithmetic, but each is one more message (alpha) and, on
  NCCL, one more ``batch_isend_irecv`` for the host to enqueue (tens of microseconds of
  Python and driver work). If the host enqueues slower than the GPU moves data, the GPU
  waits on the host. So on GPUs the pieces are big (32 MiB): enough to hide the adds,
  few enough that the host stays ahead.
- **lanes** (striping). A message of at least ``stripe_min_bytes`` is split into
  ``lanes`` parts, each sent through its own process group. Under NCCL each group is its
  own communicator, with its own CUDA stream and its own thread blocks (one per channel),
  and the parts travel at the same time. Why: NCCL gives point-to-point traffic a limited
  number of channels per peer, and a ring step's send and receive share one kernel. In the
  first sweep on 2x H200 our all-gather — a single ring step, 128 MiB each way — took
  0.97 ms where NCCL's own all-gather took 0.55 ms, over the same NVLink. Two communicators
  put twice the thread blocks on the same links. Gloo gains nothing (the CPU cores are
  already busy), so it uses one lane. ``python -m layer2_comm.commands tune`` measures the
  ring step and each collective with 1, 2 and 4 lanes: the default is a bet it checks.
- **check**. Before moving data each collective swaps a small header with its peers
  (``p2p.agree``) so that ranks that disagree get a ValueError instead of garbage (gloo)
  or a hang until the watchdog fires (NCCL). The header travels on a CPU (gloo) group, so it
  never waits for the GPU; it still costs one host round trip (tens of microseconds),
  which is most of a small message's time. ``check=False`` skips it: for benchmarks of
  latency, and for code whose shapes are known to agree.

Override with environment variables (read at every call, so a launched rank inherits
them) — ``LLM_STACK_L2_CHUNK_BYTES``, ``LLM_STACK_L2_MAX_PIECES``, ``LLM_STACK_L2_LANES``,
``LLM_STACK_L2_STRIPE_MIN_BYTES``, ``LLM_STACK_L2_CHECK`` (0/1) — or in code with
``with override(lanes=1): ...``. Every rank must use the same values: the header carries
the resolved pieces and lanes, so ranks that differ there get a ValueError; ``check`` must
agree too (a rank that skips the header round leaves its peers waiting for its header).
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace

from . import group


@dataclass(frozen=True)
class Tuning:
    """How the collectives cut, stripe and check their messages (see the module docstring)."""

    chunk_bytes: int
    max_pieces: int
    lanes: int
    stripe_min_bytes: int
    check: bool

    def __post_init__(self) -> None:
        if (
            self.chunk_bytes < 1
            or self.max_pieces < 1
            or self.lanes < 1
            or self.stripe_min_bytes < 0
        ):
            raise ValueError("need chunk_bytes, max_pieces, lanes >= 1 and "
                             f"stripe_min_bytes >= 0, got {self}")

    def pieces(self, segment_bytes: int) -> int:
        """How many pipeline pieces a ring segment of ``segment_bytes`` is cut into."""
        return max(1, min(self.max_pieces, math.ceil(segment_bytes / self.chunk_bytes)))


DEFAULTS = {
    # 32 MiB pieces: a 256 MiB all-reduce on 2 GPUs is 4 pieces per segment; 2 lanes above 8 MiB.
    "nccl": Tuning(
        chunk_bytes=32 << 20, max_pieces=8, lanes=2, stripe_min_bytes=8 << 20, check=True
    ),
    "gloo": Tuning(
        chunk_bytes=4 << 20, max_pieces=8, lanes=1, stripe_min_bytes=8 << 20, check=True
    ),
}
ENV = {"chunk_bytes": "LLM_STACK_L2_CHUNK_BYTES", "max_pieces": "LLM_STACK_L2_MAX_PIECES",
       "lanes": "LLM_STACK_L2_LANES", "stripe_min_bytes": "LLM_STACK_L2_STRIPE_MIN_BYTES",
       "check": "LLM_STACK_L2_CHECK"}
_overrides: list[dict] = []  # a stack: nested override() blocks


def _from_env(name: str, text: str) -> int | bool:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{ENV[name]}={text!r} is not an integer") from None
    return bool(value) if name == "check" else value


def current(backend: str | None = None) -> Tuning:
    """The settings in force now: backend default, then environment, then ``override``."""
    base = DEFAULTS[backend or group.backend()]
    changes: dict = {}
    for f in fields(Tuning):
        text = os.environ.get(ENV[f.name])
        if text not in (None, ""):
            changes[f.name] = _from_env(f.name, text)
    for layer in _overrides:
        changes.update(layer)
    return replace(base, **changes) if changes else base


@contextmanager
def override(**changes) -> Iterator[Tuning]:
    """Use other settings inside a ``with`` block (on every rank alike), e.g. lanes=1."""
    unknown = set(changes) - {f.name for f in fields(Tuning)}
    if unknown:
        raise ValueError(f"unknown tuning field(s) {sorted(unknown)}; known: "
                         f"{[f.name for f in fields(Tuning)]}")
    replace(DEFAULTS["gloo"], **changes)  # validates the values now, not at first use
    _overrides.append(dict(changes))
    try:
        yield current()
    finally:
        _overrides.pop()
