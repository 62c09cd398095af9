"""A worker process (ranks 1..world-1), whatever part of the model it runs: one loop for all.

Rank 0 runs layer 4's engine; the workers run only their part of the model: a tensor-parallel
shard, a pipeline stage, or a tensor-parallel shard of a stage. Two channels join them:
- control: small Python messages (what to do next, and host-side integers) come through a
  ring buffer in shared memory that rank 0 writes once for all workers (shm_broadcast.py);
  replies go back through a Pipe per worker. A worker idles on the ring between steps, for
  as long as the engine idles, with no collective timing out; it checks every second that
  rank 0 lives.
- data: one broadcast over the process group carries the step's device tensors, packed
  into one int64 tensor (token ids | slot_mapping | block_tables), so under NCCL rank 0
  never copies them to the host (step.py).

What a worker runs is its *program*, built inside the worker from the whole model by a
module-level function rank 0 names (`build`: tensor_parallel.engine.build_shard,
pipeline_parallel.engine.build_stage). A program has
    module                                 the rank's part of the model (config, dtype, device)
    make_cache(num_blocks, block_size)     its paged KV cache (its heads, its layers)
    step(msg, rank, cache, events, fault)  one step announced by msg; returns seconds computed
    message(msg, rank, conn, cache, fault) (optional) the form's own messages (tensor
                                           parallelism: "graphs" captures the decode CUDA
                                           graphs, "graph" replays one: graphs.py)
and this loop does the rest:

    ("init", num_blocks, block_size)   make the cache -> ("cache", kv_bytes)
    ("copy", pairs)                    copy-on-write block copies (every rank: same blocks)
    ("step", query_lens, seq_lens, max_blocks, has_cache, last_only, cuts, greedy)   program.step
    ("timings",)                       -> ("timings", seconds computed since the last ask, the
                                          latest ("F", micro-batch, start, end) intervals)
    ("stop",)                          leave

It answers ("ready", full config, the rank's config, weight bytes) once built, and ("error",
text) before it exits on any exception (so rank 0 can name what went wrong on which rank).

A worker never outlives rank 0 (`die_with_parent`): killed rank 0s (`timeout`'s SIGTERM, a
SIGKILL, pytest-timeout's os._exit) do not run their teardown, and a worker left behind keeps
its GPU memory (and, through CUDA IPC, rank 0's tensors it was built from) for ever. The
kernel kills the worker when its parent dies (Linux's PR_SET_PDEATHSIG), and a watchdog
thread checks the parent pid twice a second for whatever that misses (a worker stuck in a
long call: sleeping, loading, inside a collective).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import parent_process
from multiprocessing.connection import Connection

import torch
from torch import nn

import layer4_algorithms as engine

from .comm import TPComm, new_group

POLL_S = 1.0  # how often an idle worker checks that rank 0 is still alive
WATCH_S = 0.5  # how often the watchdog thread checks that the parent process lives
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
EVENTS = 4096  # compute intervals a worker keeps for "timings" (the latest ones)


@dataclass
class Rank:
    """Where a process stands in its group: what a program's build and step get.
    store: the group's TCPStore (sub-groups are made over it); None for "ours"."""

    rank: int
    world: int
    comm: TPComm
    device: torch.device
    timeout_s: float  # the step limit (waits inside a step)
    store: object = None
    # the start-up limit (sub-groups made while building): join_group always sets it
    start_timeout_s: float | None = None


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's distinct parameters and persistent buffers (tied weights once)."""
    seen: dict[int, int] = {}
    for t in module.state_dict().values():
        seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
    return sum(seen.values())


def load_full(source: tuple, device: torch.device):
    """The whole model on this worker: ("path", dir, backend, dtype) loads the checkpoint;
    ("state", config, state_dict, backend, cls) rebuilds it from rank 0's (shared-memory)
    tensors as a `cls` (layer 3's LlamaModel, or the MoE model of expert_parallel/);
    ("random", config, backend, dtype, seed, std) draws rank 0's random weights again, on
    this worker's device (random_source.py)."""
    l3 = engine.executor
    if source[0] == "path":
        _, path, backend, dtype = source
        return l3.load(path, backend=backend, dtype=dtype, device=device).net
    if source[0] == "random":
        from .random_source import random_net  # noqa: PLC0415

        _, config, backend, dtype, seed, std = source
        return random_net(config, backend=backend, dtype=dtype, device=device, seed=seed,
                          std=std)
    _, config, state, backend, cls = source
    with l3.meta_device():
        net = cls(config, backend=backend)
    net.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:
        net.lm_head.weight = net.embed.weight
    net.init_rope(device)
    return net.eval()


def worker_main(rank: int, world: int, port: int, backend: str, comm_backend: str, check: bool,
                timeout_s: float, threads: int, source: tuple, conn: Connection,
                fault: str | None = None, *, build, options: dict,
                pdeathsig: bool = True, start_timeout_s: float | None = None) -> None:
    """Entry point of worker `rank`: join the group, build the program (`build(full_model,
    Rank, **options)`), serve steps until ("stop",). port: rank 0's TCPStore (its own group),
    or the default group's rendezvous ("ours"). fault (tests only): "die" exits at the first
    step, "hang" sleeps in it; "shape" makes the program send a wrong size (each program says
    where; tensor parallelism also has "graph-die" and "graph-hang"); "start-hang" sleeps
    once in the group, before building (a rank that never comes up). pdeathsig: see
    die_with_parent (False when rank 0 started the worker from a thread other than its main
    one). timeout_s: the step limit; start_timeout_s: the start-up limit (joining, building;
    None: timeout_s)."""

    def body() -> None:
        me = join_group(rank, world, port, backend, comm_backend, check, timeout_s, threads,
                        start_timeout_s)
        if fault == "start-hang":
            time.sleep(3600)
        full = load_full(source, me.device)
        program = build(full, me, **options)
        conn.send(("ready", full.config, program.module.config, weight_bytes(program.module)))
        del full
        _serve(program, me, conn, fault)

    run_worker(conn, body, pdeathsig=pdeathsig)


def die_with_parent(pdeathsig: bool = True) -> None:
    """Make this process (started by multiprocessing) exit as soon as its parent is gone.

    pdeathsig: ask Linux to SIGKILL us when the parent dies (prctl PR_SET_PDEATHSIG). The
    kernel means the parent *thread* that started us: pass it only when the parent started
    this process from its main thread (a helper thread that ends would take us with it).
    Always: a daemon thread that checks every WATCH_S that the parent's pid is still our
    parent's (an orphan is re-parented to init or a subreaper), and os._exit(1)s when not,
    whatever the main thread is stuck in. A parent already gone when we start: exit now."""
    parent = parent_process()
    want = parent.pid if parent is not None else os.getppid()
    if pdeathsig and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no prctl here: the watchdog alone
            pass
    if os.getppid() != want:  # died before the prctl above: nobody would signal us
        os._exit(1)

    def watch() -> None:
        while os.getppid() == want:
            time.sleep(WATCH_S)
        try:
            os.write(2, f"[{os.getpid()}] parent process {want} is gone: exiting\n".encode())
        finally:
            os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def join_group(rank: int, world: int, port: int, backend: str, comm_backend: str, check: bool,
               timeout_s: float, threads: int, start_timeout_s: float | None = None) -> Rank:
    """A worker's start: threads, device, and the group (its own, or the default one for
    "ours"), joined within the start-up limit (None: timeout_s, the step limit)."""
    start_s = start_timeout_s or timeout_s
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if comm_backend == "ours":
        engine.comm.init(backend, timeout_s=start_s)
        return Rank(rank, world, TPComm(comm_backend, check=check), device, timeout_s,
                    start_timeout_s=start_s)
    pg, store = new_group(backend, rank, world, port, start_s)
    comm = TPComm(comm_backend, check=check, pg=pg)
    comm.store = store  # kept alive as long as the group
    return Rank(rank, world, comm, device, timeout_s, store, start_s)


def run_worker(conn: Connection, body, *, pdeathsig: bool = True) -> None:
    """Run a worker's body (first making sure it dies with its parent: die_with_parent); on
    any exception send ("error", text) to rank 0 first. Either way leave at once (os._exit:
    peers and rank 0 are done with us; skip the slow teardown)."""
    die_with_parent(pdeathsig)
    try:
        body()
    except BaseException as exc:  # report everything, then leave at once (as layer 2's launch does)
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        except OSError:
            pass
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def control_messages(conn: Connection, parent, who: str) -> Iterator[tuple]:
    """Rank 0's control messages, in order, until ("stop",); while none comes, check every
    POLL_S that rank 0 (the parent process) still lives: a worker whose engine died stops
    instead of idling forever."""
    while True:
        while not conn.poll(POLL_S):
            if parent is not None and not parent.is_alive():
                raise RuntimeError(f"rank 0 died; this {who} stops")
        msg = conn.recv()
        if msg[0] == "stop":
            return
        yield msg


@torch.no_grad()
def _serve(program, me: Rank, conn: Connection, fault: str | None) -> None:
    cache, parent, busy, events = None, parent_process(), 0.0, deque(maxlen=EVENTS)
    for msg in control_messages(conn, parent, f"rank {me.rank}"):
        kind = msg[0]
        if kind == "init":
            cache = program.make_cache(msg[1], msg[2])
            conn.send(("cache", cache.nbytes))
        elif kind == "copy":
            cache.copy_blocks(msg[1])
        elif kind == "step":
            if fault == "die":
                os._exit(3)
            if fault == "hang":  # a worker stuck mid-step: rank 0 must not wait for ever
                time.sleep(3600)
            busy += program.step(msg, me, cache if msg[4] else None, events, fault)
        elif kind == "timings":
            conn.send(("timings", busy, list(events)))
            busy = 0.0
            events.clear()
        elif hasattr(program, "message"):
            program.message(msg, me, conn, cache, fault)
        else:
            raise ValueError(f"unknown message {kind!r} from rank 0")
