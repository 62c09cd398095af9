"""Rank 0's side of a group of ranks (any parallel form): start the workers, talk, stop them.

`WorkerGroup.start(...)` spawns ranks 1..p-1 (torch.multiprocessing, "spawn"), each running
worker.py's loop over the program `build` makes, joins the process group as rank 0 (it hosts
the rendezvous store) and (`wait_ready`) waits until every worker has built its part of the model.
Two limits bound the waits: `start_timeout_s` the start-up (spawning, rendezvous, each worker
building its part, the KV caches, decode graphs), `timeout_s` (the step limit) everything once
every rank is up (`steps_begin`: from then on rank 0's collectives, the ring, replies and the
step's GPU work), so a rank that hangs mid-step is found within the step limit however slowly
the ranks started.
Each timeout's error names its limit. When anything fails — a worker raises, dies, or
a collective times out — `failed()` turns it into one RuntimeError naming every rank's
problem, stops the workers and leaves the process group, so nothing hangs and a new engine
can start in this process afterwards.

Each group owns its process group (comm.new_group: its own TCPStore and gloo/NCCL backend,
not torch.distributed's default group), so several engines live in one process. Only the
"ours" backend (layer 2's collectives) takes the default group: one such engine at a time.

Killed, rank 0 takes its workers along: each worker dies with its parent (worker.py's
die_with_parent), within half a second, whatever it is doing. Rank 0 keeps SIGTERM's default
action on purpose: a Python handler (kill the workers, then exit) runs only once the main
thread is back in the interpreter, so a rank 0 stuck in a CUDA or NCCL call would outlive
`timeout`'s SIGTERM; the default action ends it at once, and its workers follow.

Threads: every rank, rank 0 included, computes with `threads` CPU threads (default
cores // world): rank 0 keeping all the cores while the workers take their share
oversubscribes the CPU. Rank 0's count is restored when its last group shuts down.
"""
from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import layer4_algorithms as engine

from .comm import ABORT_S, FAILED_ABORT_S, TPComm, host_store, new_group
from .environ import environ
from .shm_broadcast import RingConn, ShmRing
from .worker import worker_main

SPIN_S = {"nccl": 0.05, "gloo": 0.0}  # workers spin on the ring (GPU hosts: cores to spare)
SPIN_PAUSE_S = 2e-5  # ... pausing this long between reads (0: sched_yield; shm_broadcast.py)
GRACE_S = 3.0  # after a failure: how long the other workers may still report theirs
# send() checks the workers' processes at most this often (a check is one waitpid per worker,
# every step); a worker that dies in between is caught by the waits (ring, events), which
# check as they wait
SEND_CHECK_S = 0.1
_threads = {"saved": None, "live": 0}  # rank 0's torch threads before its first live group
#: set to a callable(str) (a benchmark's log) to hear each start-up phase as it ends
progress = None


def note(what: str) -> None:
    """Tell `progress` (if set) that a start-up phase ended."""
    if progress is not None:
        progress(what)


def end_processes(procs, deadline: float) -> None:
    """Let each process exit by itself until `deadline` (time.monotonic()), then terminate
    what is left, then kill what survives that (2 s each)."""
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(10.0)  # a killed process frees its GPU memory before it is reaped


class WorkerGroup:
    """Workers' processes and control pipes, the collectives, and the group's health."""

    def __init__(self, procs: list, conns: list, comm: TPComm | None, backend: str,
                 timeout_s: float, start_timeout_s: float | None = None) -> None:
        self.procs, self.conns, self.comm = procs, conns, comm
        self.backend, self.timeout_s = backend, timeout_s  # the step limit
        self.start_timeout_s = start_timeout_s or timeout_s  # the start-up limit
        self.world = len(procs) + 1
        self.error: str | None = None
        self.label = "tensor-parallel"
        self.store = None  # the TCPStore rank 0 hosts (own process group)
        self.ring: ShmRing | None = None  # rank 0 -> every worker: each step's message
        self.extra_comms: list[TPComm] = []  # more groups of rank 0's (pipeline: the logits')
        self.stage_comms: list[TPComm] = []  # rank 0's sub-groups its part owns (a stage's TP)
        self.control_s = 0.0  # seconds rank 0 spent sending control messages (pipes)
        self._next_check = 0.0  # send(): when to check the workers' processes next
        self._threads_set = False
        self.stepping = False  # every rank up (steps_begin): the step limit bounds the waits
        # per worker: ("ready", full config, shard config, weight bytes)
        self.worker_info: list[tuple] = []

    @classmethod
    def start(cls, world: int, source: tuple, *, device: torch.device, comm_backend: str = "torch",
              check: bool = False, timeout_s: float = 60.0,
              start_timeout_s: float | None = None, threads: int | None = None,
              faults: dict[int, str] | None = None, build, options: dict | None = None,
              label: str = "tensor-parallel") -> WorkerGroup:
        """build(full_model, worker.Rank, **options): makes each worker's program (a
        module-level function); label: how errors name the group. timeout_s: the step limit;
        start_timeout_s: the start-up limit (None: timeout_s)."""
        ours = comm_backend == "ours"
        if ours and dist.is_available() and dist.is_initialized():
            raise RuntimeError("tp_backend='ours' runs over torch.distributed's default process "
                               "group and this process is already in one (another engine on "
                               "'ours'?); close() it first, or use tp_backend='torch' (each "
                               "engine its own group)")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl" and torch.cuda.device_count() < world:
            raise ValueError(f"{label} size {world} on CUDA needs {world} GPUs (one per rank); "
                             f"{torch.cuda.device_count()} are visible")
        threads = threads or max(1, (os.cpu_count() or 1) // world)
        start_s = start_timeout_s or timeout_s
        store = None if ours else host_store(world, start_s)
        port = engine.comm.free_port() if ours else store.port
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        ring = ShmRing.create(world - 1, spin_s=SPIN_S[backend], pause_s=SPIN_PAUSE_S)
        main = threading.current_thread() is threading.main_thread()  # see die_with_parent
        for rank in range(1, world):
            mine, theirs = ctx.Pipe(duplex=True)
            chan = RingConn(theirs, ring.reader_end(rank - 1))  # messages in: ring; replies: pipe
            p = ctx.Process(target=worker_main, name=f"l5-rank{rank}", daemon=True,
                            args=(rank, world, port, backend, comm_backend, check, timeout_s,
                                  threads, source, chan, (faults or {}).get(rank)),
                            kwargs={"build": build, "options": options or {},
                                    "pdeathsig": main, "start_timeout_s": start_s})
            p.start()
            theirs.close()
            procs.append(p)
            conns.append(mine)
        group = cls(procs, conns, None, backend, timeout_s, start_s)
        group.store, group.label, group.ring = store, label, ring
        group._set_threads(threads)
        note(f"{label}: {world - 1} worker process(es) spawned")
        with group.guard("starting the workers"):
            if ours:
                _init_rank0(backend, world, port, start_s)
                group.comm = TPComm(comm_backend, check=check)
            else:
                pg, _ = new_group(backend, 0, world, port, start_s, store=store)
                group.comm = TPComm(comm_backend, check=check, pg=pg)
        note(f"{label}: process group of {world} joined ({backend}, {comm_backend})")
        return group

    def wait_ready(self) -> list[tuple]:
        """Each worker's ("ready", full config, its part's config, weight bytes), once built
        (rank 0 builds its own part first: a part may need rank 0 to build, e.g. a sub-group)."""
        with self.guard("starting the workers"):
            self.worker_info = self.gather("ready", start_up=True)
        note(f"{self.label}: every worker built its part "
             f"({sum(i[3] for i in self.worker_info) / 2**30:.2f} GiB of weights)")
        return self.worker_info

    def _set_threads(self, threads: int) -> None:
        """Rank 0 computes with `threads` too (the first live group saves the old count)."""
        if _threads["live"] == 0:
            _threads["saved"] = torch.get_num_threads()
        _threads["live"] += 1
        self._threads_set = True
        torch.set_num_threads(threads)

    def _restore_threads(self) -> None:
        if self._threads_set:
            self._threads_set = False
            _threads["live"] -= 1
            if _threads["live"] == 0 and _threads["saved"] is not None:
                torch.set_num_threads(_threads["saved"])

    # ---- messages ------------------------------------------------------------------------------
    def send(self, msg: tuple) -> None:
        """A control message to every worker, through the shared-memory ring (one write for
        all; a worker found dead fails now, one that stopped reading within timeout_s). The
        processes are checked at most every SEND_CHECK_S here: per decode step that is most
        of the message's cost."""
        start = time.perf_counter()
        if start >= self._next_check:
            self.check_alive()
            self._next_check = start + SEND_CHECK_S
        self.ring.put(msg, timeout_s=self.timeout_s, alive=self.check_alive)
        self.control_s += time.perf_counter() - start

    def make_caches(self, cache) -> list[int]:
        """Each worker makes its paged KV cache with rank 0's block count and size (one set of
        block tables serves every rank); returns each worker's cache bytes."""
        with self.guard("making the KV caches"):
            self.send(("init", cache.num_blocks, cache.block_size))
            out = [m[1] for m in self.gather("cache", start_up=True)]
        note(f"{self.label}: KV caches made ({cache.num_blocks} blocks a rank)")
        return out

    def steps_begin(self) -> None:
        """Every rank is up (built, caches made, graphs captured: the engine calls this last):
        rank 0's collectives wait at most the step limit from now on (they were made with the
        start-up limit, which bounds their rendezvous)."""
        self.stepping = True
        if self.start_timeout_s == self.timeout_s:
            return
        step = timedelta(seconds=self.timeout_s)
        for comm in (self.comm, *self.extra_comms, *self.stage_comms):
            if comm is not None and comm.pg is not None:
                comm.pg.set_timeout(step)

    def gather(self, kind: str, *, start_up: bool = False) -> list[tuple]:
        """Each worker's next reply, which must be of `kind`, within the step limit (start_up:
        the start-up limit)."""
        limit = self.start_timeout_s if start_up else self.timeout_s
        deadline, out = time.monotonic() + limit, []
        for rank, c in enumerate(self.conns, start=1):
            while not c.poll(0.1):
                self.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank} did not answer {kind!r} within "
                                       + limit_text(start_up, limit))
            msg = c.recv()
            if msg[0] != kind:
                raise RuntimeError(f"rank {rank} answered {msg[0]!r} instead of {kind!r}"
                                   + (f": {msg[1]}" if msg[0] == "error" else ""))
            out.append(msg)
        return out

    def check_alive(self) -> None:
        dead = [(r, p.exitcode) for r, p in enumerate(self.procs, start=1) if not p.is_alive()]
        if dead:
            raise RuntimeError(", ".join(f"rank {r} exited (code {c})" for r, c in dead))

    # ---- failure -------------------------------------------------------------------------------
    def guard(self, what: str) -> _Guard:
        """`with group.guard(what):` a block that talks to the workers; any exception in it ->
        failed(). (A class, not a generator context manager: rank 0 enters one every step.)"""
        if self.error is not None:
            raise RuntimeError(f"the {self.label} group is closed: {self.error}")
        return _Guard(self, what)

    def failed(self, what: str, exc: BaseException) -> RuntimeError:
        """Collect every worker's report (a short grace period), stop them all, leave the group."""
        lines = [f"{self.label} {what} failed on rank 0: {type(exc).__name__}: {exc}"]
        text = str(exc).lower()
        if (isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text) \
                and "_timeout_s)" not in text:  # a wait of torch's: name the limit it had
            limit = self.timeout_s if self.stepping else self.start_timeout_s
            lines[0] += f" ({limit_text(not self.stepping, limit)} ran out)"
        deadline = time.monotonic() + GRACE_S
        for rank, (p, c) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
            report = None
            while report is None and time.monotonic() < deadline:
                try:
                    if c.poll(0.05):
                        msg = c.recv()
                        report = msg[1].splitlines()[0] if msg[0] == "error" else None
                    elif not p.is_alive():
                        report = f"died (exit code {p.exitcode})"
                except (EOFError, OSError):
                    p.join(0.5)
                    report = f"died (exit code {p.exitcode})"
            if report is not None:
                lines.append(f"rank {rank}: {report}")
        self.error = "; ".join(lines)
        self.shutdown(graceful=False)
        return RuntimeError("\n".join(lines))

    def shutdown(self, *, graceful: bool = True, timeout_s: float = 5.0) -> None:
        """Stop the workers ("stop" first when graceful, then terminate/kill); leave the group."""
        if graceful and self.error is None and self.ring is not None:
            try:
                self.ring.put(("stop",), timeout_s=min(timeout_s, self.timeout_s))
            except (TimeoutError, ValueError):
                pass
        end_processes(self.procs, time.monotonic() + (timeout_s if graceful else 0.5))
        for c in self.conns:
            c.close()
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        self.procs, self.conns = [], []
        self.error = self.error or "the engine was closed (llm.close())"
        self._restore_threads()
        abort_wait_s = ABORT_S if graceful else FAILED_ABORT_S
        for comm in self.extra_comms:
            comm.close(abort_wait_s)
        self.extra_comms = []
        if self.comm is not None and self.comm.pg is not None:  # our own group
            self.comm.close(abort_wait_s)
        elif self.store is None:  # "ours": the default group
            engine.comm.destroy()
        self.store = None


class _Guard:
    """WorkerGroup.guard's context: an exception in the block -> the group's failed()."""

    __slots__ = ("group", "what")

    def __init__(self, group: WorkerGroup, what: str) -> None:
        self.group, self.what = group, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None:
            raise self.group.failed(self.what, exc) from exc
        return False


def limit_text(start_up: bool, seconds: float) -> str:
    """How an error names the limit that ran out (and the config field that sets it)."""
    if start_up:
        return f"the start-up limit of {seconds:g} s (tp_start_timeout_s)"
    return f"the step limit of {seconds:g} s (tp_timeout_s)"


def _init_rank0(backend: str, world: int, port: int, timeout_s: float) -> None:
    """Join as rank 0 through layer 2's init (env://), leaving this process's env as it was."""
    with environ(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(world),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)):
        engine.comm.init(backend, timeout_s=timeout_s)
