"""launch(): run a function on N ranks of this machine, for tests, demos and labs.

It is a small local torchrun: it picks a free port on 127.0.0.1, spawns one process per
rank (start method "spawn", so CUDA and threads are safe; or "forkserver", named in
START_METHOD_ENV, where one process launches many times, as a lab grader does: each rank is
then forked from a server that imported torch once, instead of importing it itself), gives
each the launching process's environment as it is at the launch, sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, calls `init(backend)` and then
`fn(*args)`. Each child sends back, over its own pipe, either its pickled return value or
its exception with the traceback.

Nothing it starts outlives it and nothing hangs it. After the first rank fails the others
get a short grace period to report (a shape mismatch fails on both sides at once) and are
then stopped — they would otherwise sit in a receive from the dead rank until the process
group timeout. Ranks still running at `timeout_s` are stopped too, and the RuntimeError
names every rank that raised, died, or did not finish.
"""
from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

import torch
import torch.multiprocessing as mp

from . import group

GRACE_S = 3.0  # how long the other ranks may still report after one has failed
#: "spawn" (unset) or "forkserver": how the rank processes start
START_METHOD_ENV = "LLM_STACK_LAUNCH_START_METHOD"


def _context():
    method = os.environ.get(START_METHOD_ENV) or "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":  # the server imports torch once; no CUDA is initialised there
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def _worker(rank: int, world: int, port: int, backend: str, timeout_s: float,
            fn: Callable, args: tuple, conn: Connection, environ: dict) -> None:
    os.environ.clear()  # the launcher's environment now (a fork server holds the one it began with)
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        group.init(backend, timeout_s=timeout_s)
        payload = pickle.dumps(("ok", fn(*args)))
    except BaseException as exc:  # report everything, even SystemExit, then leave at once
        conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: "
                                               f"{exc}", traceback.format_exc())))
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter shutdown: a process group with a pending receive can block in
        # its destructor, and the parent has what it needs.
        os._exit(1)
    conn.send_bytes(payload)
    conn.close()
    try:  # leave together, so rank 0 (which hosts the store) is not gone while others finish
        import torch.distributed as dist
        kwargs = {"device_ids": [group.local_rank()]} if group.backend() == "nccl" else {}
        dist.barrier(**kwargs)
        group.destroy()
    except Exception:  # the result is delivered; a peer that died later is reported by the parent
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's slow teardown (most of a second with torch loaded)


def _stop(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)


def _name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def launch(fn: Callable, world_size: int, *args, backend: str = "auto",
           timeout_s: float = 60.0) -> list:
    """Run `fn(*args)` on `world_size` ranks; returns their return values, index = rank.

    `fn` must be importable by name (a module-level function) and its return value
    picklable. Raises RuntimeError naming the ranks that raised (with their tracebacks),
    died, or did not finish within `timeout_s` seconds (those are killed).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    backend = group.resolve_backend(backend)
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(f"{world_size} ranks need {world_size} GPUs with NCCL; "
                         f"{torch.cuda.device_count()} are visible")
    ctx = _context()
    port = group.free_port()
    procs, conns = [], []
    start = time.monotonic()
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, name=f"layer2-rank{rank}", daemon=True,
                            args=(rank, world_size, port, backend, timeout_s, fn, args, writer,
                                  dict(os.environ)))
            p.start()
            writer.close()  # the child holds the only writer: EOF means it is gone
            procs.append(p)
            conns.append(reader)
        results, errors, first_error = _collect(procs, conns, start + timeout_s)
        pending = [r for r in range(world_size) if r not in results and r not in errors]
    finally:
        for p in procs:  # finished ranks are leaving; give them a moment, then stop all
            p.join(timeout=max(0.0, min(5.0, start + timeout_s - time.monotonic())))
        _stop(procs)
        for c in conns:
            c.close()
    if not errors and not pending:
        return [results[r] for r in range(world_size)]
    head = f"launch({_name(fn)}, world_size={world_size}, backend={backend!r}) failed:"
    lines = [head] + [f"rank {r} {errors[r]}" for r in sorted(errors)]
    if pending and errors:
        lines.append(f"rank(s) {pending} were still running {GRACE_S:.0f} s after rank "
                     f"{first_error} failed (waiting on it, most likely) and were stopped")
    elif pending:
        lines.append(f"rank(s) {pending} did not finish within timeout_s={timeout_s:g} s and were "
                     f"stopped; rank(s) {sorted(results)} finished")
    raise RuntimeError("\n".join(lines))


def _collect(procs: list, conns: list[Connection], deadline: float):
    """Read each rank's report until all are in, one failed (+ grace), or the deadline."""
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    first_error: int | None = None
    failed_at = None
    waiting = set(range(len(procs)))
    while waiting:
        limit = deadline if failed_at is None else min(deadline, failed_at + GRACE_S)
        left = limit - time.monotonic()
        if left <= 0:
            break
        handles = {conns[r]: r for r in waiting} | {procs[r].sentinel: r for r in waiting}
        for ready in wait(list(handles), timeout=left):
            rank = handles[ready]
            if rank not in waiting:
                continue
            report = _read(conns[rank], procs[rank])
            if report is None:  # sentinel fired with nothing to read yet: re-check next round
                continue
            waiting.discard(rank)
            if report[0] == "ok":
                results[rank] = report[1]
            else:
                errors[rank] = report[1]
                if first_error is None:
                    first_error, failed_at = rank, time.monotonic()
    return results, errors, first_error


def _read(conn: Connection, proc) -> tuple | None:
    """("ok", value) or ("error", text) for a rank that reported or died; None if neither."""
    if conn.poll():
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            proc.join(timeout=1.0)
            return ("error", f"died without reporting (exit code {proc.exitcode})")
        except Exception as exc:  # a return value that cannot be unpickled here
            return ("error", f"returned a value this process cannot unpickle: {exc!r}")
        if message[0] == "ok":
            return message
        return ("error", f"raised {message[1]}\n{_indent(message[2])}")
    if not proc.is_alive():
        return ("error", f"died without reporting (exit code {proc.exitcode}; killed by a "
                         "signal, out of memory, or os._exit?)")
    return None


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())
