"""Pipeline schedules as explicit lists: what each stage does, in order.

A schedule for stage s of p stages over m micro-batches is a list of `Op`s — ("F", i) runs
micro-batch i forward, ("B", i) runs it backward. The executor (training.py) walks the list;
receives block until the neighbour has sent, so the list alone fixes the timeline.

GPipe (Huang et al. 2019): every forward, then every backward.
    stage 0 of 3, m = 4:  F0 F1 F2 F3 B0 B1 B2 B3
    Simple, but stage s holds the activations of all m micro-batches at the peak.

1F1B (PipeDream-Flush, Narayanan et al. 2021): p-1-s warm-up forwards, then alternate one
forward and one backward, then the remaining backwards.
    stage 0 of 3, m = 4:  F0 F1 F2 B0 F3 B1 B2 B3
    stage 2 of 3, m = 4:  F0 B0 F1 B1 F2 B2 F3 B3
    Same bubble as GPipe, but at most p - s micro-batches are in flight on stage s, so the
    activation memory is bounded by the depth, not by m.

The bubble: with forward time t_f and backward t_b per micro-batch per stage, both schedules
take (m + p - 1)(t_f + t_b); each stage is busy m(t_f + t_b) of it, so the idle fraction is
(p - 1) / (m + p - 1). `simulate` replays a schedule with given op times to show it.
"""
from __future__ import annotations

from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b")


class Op(NamedTuple):
    kind: str  # "F" or "B"
    micro: int  # micro-batch index

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}"


def _check(stage: int, stages: int, micro: int) -> None:
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in 0..{stages - 1}, got {stage}")
    if micro < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro}")


def gpipe(stage: int, stages: int, micro: int) -> list[Op]:
    """All forwards, then all backwards (in micro-batch order)."""
    _check(stage, stages, micro)
    return [Op("F", i) for i in range(micro)] + [Op("B", i) for i in range(micro)]


def one_f_one_b(stage: int, stages: int, micro: int) -> list[Op]:
    """Warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    _check(stage, stages, micro)
    warmup = min(stages - 1 - stage, micro)
    ops = [Op("F", i) for i in range(warmup)]
    fwd, bwd = warmup, 0
    while fwd < micro:  # steady state: each new forward is followed by the oldest backward
        ops += [Op("F", fwd), Op("B", bwd)]
        fwd, bwd = fwd + 1, bwd + 1
    ops += [Op("B", i) for i in range(bwd, micro)]
    return ops


def schedule(name: str, stage: int, stages: int, micro: int) -> list[Op]:
    """The op list of schedule `name` ("gpipe" or "1f1b") for one stage."""
    if name == "gpipe":
        return gpipe(stage, stages, micro)
    if name == "1f1b":
        return one_f_one_b(stage, stages, micro)
    raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULES}")


def bubble_fraction(stages: int, micro: int) -> float:
    """The ideal idle fraction of a stage, (p - 1) / (m + p - 1)."""
    if stages < 1 or micro < 1:
        raise ValueError(f"stages and micro_batches must be >= 1, got {stages}, {micro}")
    return (stages - 1) / (micro + stages - 1)


def max_in_flight(ops: list[Op]) -> int:
    """The most micro-batches whose forward ran and backward did not yet (activations held)."""
    live = peak = 0
    for op in ops:
        live += 1 if op.kind == "F" else -1
        peak = max(peak, live)
    return peak


def simulate(name: str, stages: int, micro: int, t_f: float = 1.0,
             t_b: float = 2.0) -> list[list[tuple[Op, float, float]]]:
    """Replay schedule `name` with fixed op times: per stage, [(op, start, end)].

    F(s, i) waits for F(s-1, i); B(s, i) waits for B(s+1, i) (and, on the last stage, for
    its own F). Each stage runs its list in order. Raises RuntimeError on a deadlock.
    """
    lists = [schedule(name, s, stages, micro) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    pos, clock = [0] * stages, [0.0] * stages
    out: list[list[tuple[Op, float, float]]] = [[] for _ in range(stages)]
    while any(pos[s] < len(lists[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if pos[s] == len(lists[s]):
                continue
            op = lists[s][pos[s]]
            if op.kind == "F":
                dep = ("F", s - 1, op.micro) if s > 0 else None
            else:
                dep = ("B", s + 1, op.micro) if s < stages - 1 else ("F", s, op.micro)
            if dep is not None and dep not in done:
                continue
            start = max(clock[s], done[dep] if dep else 0.0)
            end = start + (t_f if op.kind == "F" else t_b)
            done[(op.kind, s, op.micro)] = clock[s] = end
            out[s].append((op, start, end))
            pos[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {name!r} deadlocks at positions {pos}")
    return out
