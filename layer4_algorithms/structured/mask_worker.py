"""The grammars in a process of their own (under async scheduling with CUDA graphs): the engine
hands a step's tokens and rows over a socket and reads the filled bitmask rows back, and no
thread of the engine's process ever waits for the GIL on the grammars' behalf.

Why not a thread: with the fill on a helper thread, each step hands the GIL over and back (the
helper must hold it to start its GIL-free call and again to report it done), each time waking a
sleeping thread, which on GPU hosts cost 100-200 us a step, on the engine's critical path
(measured, then removed: 0.317x the unconstrained tokens/s against the worker's 0.467x). A process
has its own interpreter: the engine's thread only pickles a short message (the tokens to
advance, the rows to fill) and later reads the reply, which is already there when the worker
finished first. The worker also advances the grammars (llguidance's consume_token a row), so
that work leaves the engine's thread too.

    engine (this process)                      worker (python mask_worker_serve.py FD)
    GrammarCompiler.state -> RemoteGrammar     "new": compile (cached by constraint), copy
    accept_at(token): queued, no call          "fill": advance the queued tokens, fill the
    TokenMasks.submit -> MaskWorker.fill           rows into shared memory (a memfd both
    TokenMasks.wait -> one copy into the arena     map), reply with a short message

The worker runs mask_worker_serve.py as a script (stdlib, numpy and llguidance only: no
torch, no layer imports, so it starts in a fraction of a second) and exits when its socket
closes. A token the
grammar refuses (it cannot be sampled under the mask, but a state can fail) is known only in
the worker: that row's masks then allow only EOS, as in this process.
"""
from __future__ import annotations

import itertools
import mmap
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection

import numpy as np

SERVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mask_worker_serve.py")

class MaskWorker:
    """The engine's end: one worker process for one vocabulary. `new_state` starts a
    constrained sequence's grammar (its compile starts at once, there), `fill` hands a step
    over and returns a handle whose `result()` waits for the rows."""

    ROWS = 512  # rows a half of the shared memory holds (a larger request: sent as bytes)
    # seconds each side polls, awake, for the other's next message before sleeping in recv:
    # a decode step sends a request and reads a reply every ~1 ms, and waking a sleeping
    # process or thread for each cost 50-200 us on busy hosts; the worker spins a core
    # while the engine decodes, the engine at most SPIN_S a wait
    SPIN_S = 2e-3

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.eos_token_ids = tuple(eos_token_ids)
        self.W = W = (vocab_size + 31) // 32
        # the rows come back through memory both processes map (two halves in turn, so a
        # reply not read yet is never overwritten), so a reply is a short message and one
        # copy into the engine's arena; without memfd (not Linux) they come as bytes
        cap, fds = (self.ROWS, [os.memfd_create("llm-stack-masks")]) \
            if hasattr(os, "memfd_create") else (0, [])
        if cap:
            os.ftruncate(fds[0], 2 * cap * W * 4)
            self._shared = np.frombuffer(mmap.mmap(fds[0], 2 * cap * W * 4),
                                         np.int32).reshape(2, cap, W)
        ours, theirs = socket.socketpair()
        fds.insert(0, theirs.fileno())
        self.proc = subprocess.Popen([sys.executable, SERVE, *map(str, fds)], pass_fds=fds,
                                     stdin=subprocess.DEVNULL)
        for fd in fds[1:]:
            os.close(fd)  # (the map keeps the memory)
        theirs.close()
        self.conn = Connection(ours.detach())
        self._cap, self._half, self._busy = cap, 0, [False, False]
        self.pid = os.getpid()
        self._slots = itertools.count()
        self._ops: list[tuple[int, int]] = []  # (slot, token) to advance, (slot, -1) to free
        self._replies: deque[_Reply] = deque()  # sent, their replies not yet read (in order)
        self._lock = threading.Lock()  # (sends: a request may be added from another thread)
        self.spin_s = self.SPIN_S
        self._send(("init", tokenizer_json, vocab_size, list(eos_token_ids), cap, self.spin_s))
        self._finalizer = weakref.finalize(self, _shutdown, self.conn, self.proc)

    def _send(self, msg: tuple) -> None:
        if os.getpid() != self.pid:  # a forked child: the grammars are the parent's
            raise RuntimeError(f"this grammar worker belongs to process {self.pid}: a forked "
                               f"child cannot use its parent's constrained sequences")
        with self._lock:
            try:
                self.conn.send(msg)
            except OSError as e:
                raise self._died() from e

    def _died(self) -> RuntimeError:
        return RuntimeError(f"the grammar worker process died (exit code {self.proc.poll()})")

    def new_state(self, key: object, grammar: str) -> RemoteGrammar:
        """A fresh grammar state in the worker (compiled there, cached by key)."""
        slot = next(self._slots)
        self._send(("new", slot, key, grammar))
        return RemoteGrammar(self, slot, key, grammar)

    def free(self, slot: int) -> None:
        """A state no sequence holds any more: dropped there with the next request."""
        self._ops.append((slot, -1))

    def fill(self, slots: list[int], rows: np.ndarray) -> _Reply:
        """Send the queued advances and ask for rows (R, W) int32 (row j: slots[j]'s allowed
        next tokens); the handle's result() writes them into rows."""
        return self._ask(("fill", slots), rows)

    def _ask(self, msg: tuple, rows: np.ndarray | None) -> _Reply:
        ops, self._ops = self._ops, []
        half = -1  # where the worker writes the rows: a half of the shared memory, or bytes
        if rows is not None and len(rows) <= self._cap and not self._busy[self._half]:
            half, self._half = self._half, 1 - self._half
            self._busy[half] = True
        reply = _Reply(self, rows, half)
        try:
            self._send((msg[0], ops, half, *msg[1:]))
        except BaseException:  # (not sent: the advances wait for the next request)
            self._ops[:0] = ops
            if half >= 0:
                self._busy[half] = False
            raise
        self._replies.append(reply)
        return reply

    def _read(self, upto: _Reply) -> None:
        """Read replies in order until upto's is in."""
        while not upto.done:
            r = self._replies.popleft()
            try:  # b"K" + a float64 (the worker's seconds, or an answer), or b"E" + text
                if self.spin_s > 0:
                    until = time.perf_counter() + self.spin_s
                    while not self.conn.poll(0) and time.perf_counter() < until:
                        pass
                msg = self.conn.recv_bytes()
                if msg[:1] == b"E":
                    r.error = RuntimeError(f"grammar worker: {msg[1:].decode()}")
                elif r.half >= 0:
                    np.copyto(r.rows, self._shared[r.half, :len(r.rows)])
                elif r.rows is not None:  # (bytes: a 2-d view would be measured by its
                    self.conn.recv_bytes_into(r.rows.reshape(-1).view(np.uint8))  # 1st dim)
            except (EOFError, OSError) as e:
                raise self._died() from e
            finally:
                if r.half >= 0:
                    self._busy[r.half] = False
            r.value, r.done = struct.unpack_from("d", msg, 1)[0] if r.error is None else None, True

    def close(self) -> None:
        self._finalizer()


class _Reply:
    """A request to the worker; result() -> (None, the worker's answer: for a fill the
    seconds it spent), as a Future would give (the rows are written into `rows`)."""

    __slots__ = ("worker", "rows", "half", "done", "value", "error")

    def __init__(self, worker: MaskWorker, rows: np.ndarray | None, half: int) -> None:
        self.worker, self.rows, self.half = worker, rows, half
        self.done, self.value, self.error = False, None, None

    def result(self):
        self.worker._read(self)
        if self.error is not None:
            raise self.error
        return None, self.value


class RemoteGrammar:
    """A constrained sequence's grammar state kept in the worker: GrammarState's interface as
    the engine uses it (accept_at, fork, fill, fill_drafts, is_accepting, position)."""

    failed = None  # (a refused token is known in the worker only: see the module's doc)
    ready = True

    def __init__(self, worker: MaskWorker, slot: int, key: object, grammar: str) -> None:
        self.worker, self.slot, self.key, self.grammar = worker, slot, key, grammar
        self.eos_token_ids = worker.eos_token_ids
        self.num_accepted = 0
        self.position = 0
        weakref.finalize(self, worker.free, slot)

    def accept(self, token: int) -> bool:
        """Queue one sampled token (the worker takes it before the next fill); True."""
        self.worker._ops.append((self.slot, int(token)))
        self.num_accepted += 1
        return True

    def accept_at(self, token: int, position: int) -> bool:
        if position < self.position:
            return True
        self.position = position + 1
        return self.accept(token)

    def fork(self) -> RemoteGrammar:
        if self.num_accepted:
            raise RuntimeError("a grammar state forks before its first token")
        return self.worker.new_state(self.key, self.grammar)

    def fill(self, row: np.ndarray) -> None:
        self.worker.fill([self.slot], row.reshape(1, -1)).result()

    def fill_drafts(self, rows: np.ndarray, drafts: list[int]) -> None:
        """GrammarState.fill_drafts, in the worker: rows (1 + len(drafts), W)."""
        self.worker._ask(("drafts", self.slot, [int(d) for d in drafts]), rows).result()

    @property
    def is_accepting(self) -> bool:
        return bool(self.worker._ask(("accepting", self.slot), None).result()[1])


def _shutdown(conn: Connection, proc: subprocess.Popen) -> None:
    conn.close()  # the worker reads EOF and exits
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
