"""A pipeline-stage worker process (stages 1..p-1; rank 0 is stage 0 and runs the engine).

Started, joined and watched by tp_group.TPGroup exactly as a tensor-parallel worker (same
rendezvous, control pipe, liveness checks, error reports; `tp_worker.join_group`), it differs
in what it holds and what a step is. It keeps its stage of the model (pp_stage.StageNet) and
a paged KV cache of its layers, and answers rank 0's messages:

    ("init", num_blocks, block_size)   make the stage's cache -> ("cache", kv_bytes)
    ("copy", pairs)                    copy-on-write block copies (every stage: same blocks)
    ("step", query_lens, seq_lens, max_blocks, has_cache, last_only, cuts)
        receive the step's ids | slots | block tables (the broadcast TP uses too), then for each
        micro-batch i (tokens cuts[i]): receive the stream from stage s-1, run the stage's
        layers, send the stream to stage s+1 — or, on the last stage, the logits to rank 0
    ("timings",)                       -> ("timings", seconds spent computing since the last
                                          ask, the latest ("F", micro-batch, start, end)
                                          intervals): the pipeline's overlap, measured
    ("stop",)                          leave
"""
from __future__ import annotations

import os
import time
from collections import deque
from multiprocessing import parent_process
from multiprocessing.connection import Connection

import torch

from . import pp_stage as S
from .tp import weight_bytes
from .tp_worker import join_group, load_full, next_message, run_worker, unpack_step

EVENTS = 4096  # compute intervals a stage keeps for "timings" (the latest ones)


def worker_main(rank: int, world: int, port: int, backend: str, comm_backend: str, check: bool,
                timeout_s: float, threads: int, source: tuple, conn: Connection,
                fault: str | None = None, **_) -> None:
    """Entry point of stage `rank` (TPGroup.start's worker signature). fault (tests only):
    "die" exits at the first step, "shape" sends each micro-batch one row too long."""

    def body() -> None:
        comm, device = join_group(rank, world, port, backend, comm_backend, check, timeout_s,
                                  threads)
        full = load_full(source, device)
        stage = S.StageNet(full, rank, world)
        conn.send(("ready", full.config, stage.config, weight_bytes(stage)))
        del full
        _serve(stage, comm, conn, device, timeout_s, fault)

    run_worker(conn, body)


@torch.no_grad()
def _serve(stage: S.StageNet, comm, conn: Connection, device: torch.device, timeout_s: float,
           fault: str | None) -> None:
    cache, parent, busy, events = None, parent_process(), 0.0, deque(maxlen=EVENTS)
    while True:
        msg = next_message(conn, parent, "stage")
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "init":
            cache = S.StageKVCache.for_stage(stage, msg[1], msg[2])
            conn.send(("cache", cache.nbytes))
        elif kind == "copy":
            cache.copy_blocks(msg[1])
        elif kind == "step":
            if fault == "die":
                os._exit(3)
            busy += run_step(stage, comm, msg, cache if msg[4] else None, device, timeout_s,
                             events, fault)
        elif kind == "timings":
            conn.send(("timings", busy, list(events)))
            busy = 0.0
            events.clear()
        else:
            raise ValueError(f"unknown message {kind!r} from rank 0")


def run_step(stage: S.StageNet, comm, msg: tuple, cache, device: torch.device, timeout_s: float,
             events: deque, fault: str | None = None) -> float:
    """One step on stage s >= 1: every micro-batch in, through the layers, out. Returns the
    seconds spent computing (not waiting for a neighbour); appends ("F", i, start, end) per
    micro-batch to events."""
    _, qlens, slens, _, _, last_only, cuts = msg
    _, ctx = unpack_step(msg[:6], comm, device)
    s, pg = stage.stage, comm.pg
    hidden = stage.full_config.hidden_size
    parts = S.micro_contexts(qlens, slens, ctx.slot_mapping, ctx.block_tables, cuts, device)
    sends, busy = [], 0.0
    for i, (t0, t1, mctx, _) in enumerate(parts):
        inp = S.recv(pg, (2, t1 - t0, hidden), stage.dtype, s - 1, i, device, timeout_s,
                     f"stage {s} receiving")
        start = time.perf_counter()
        out = stage(inp, mctx, cache, last_only)
        end = time.perf_counter()
        busy += end - start
        events.append(("F", i, start, end))
        if fault == "shape":  # a stage whose output has one row too many
            out = torch.cat((out, out.narrow(-2, 0, 1)), dim=-2)
        sends += S.send(pg, out, 0 if stage.last else s + 1, i)
    S.wait_sends(sends, timeout_s, f"stage {s} sending")
    return busy
