"""The worker process's side of mask_worker.py: run as a script (`python mask_worker_serve.py
FD`, FD its end of a socket), with the standard library, numpy and llguidance only (no torch,
no layer imports: it starts in a fraction of a second). It holds the engine's constrained
sequences' grammars by slot and answers, in order:

    ("init", tokenizer_json, V, eos, cap, spin)
                                              the vocabulary, once; cap: rows a half of the
                                              shared memory (its fd: the 2nd argument) holds;
                                              spin: seconds to poll for the next request
                                              after a reply before sleeping in recv
    ("new", slot, key, grammar)               a state; its grammar compiled on a thread
                                              (cached by key), waited for when first used
    ("fill", ops, half, slots)                ops: (slot, token) advances, (slot, -1) frees,
                                              in order; then row j <- slots[j]'s allowed
                                              next tokens, written into that half of the
                                              shared memory (half -1: sent as bytes after
                                              the reply)
    ("drafts", ops, half, slot, drafts)       the rows of GrammarState.fill_drafts, likewise
    ("accepting", ops, -1, slot)              whether the text so far is a full match

Each is answered b"K" + a float64 (the seconds spent, or the answer: 1.0 / 0.0), or b"E" +
an error's text, which the engine raises. EOF on the socket (the engine closed it, or died)
ends the process.
"""
from __future__ import annotations

import mmap
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import numpy as np


def serve(conn: Connection, shared_fd: int | None) -> None:
    import llguidance as llg

    _, tokenizer_json, vocab_size, eos, cap, spin = conn.recv()
    tok = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)
    W = (vocab_size + 31) // 32
    shared = None  # (2, cap, W): the halves the engine reads replies' rows from
    if cap and shared_fd is not None:
        shared = np.frombuffer(mmap.mmap(shared_fd, 2 * cap * W * 4),
                               np.int32).reshape(2, cap, W)
    eos_words = np.zeros(W, np.int32)  # the row of a grammar that did not compile
    for t in eos:
        eos_words[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    # compiles run on a thread (llguidance drops the GIL while it builds), so a new schema's
    # compile overlaps the fills of the rows already decoding; a state waits for its own
    # compile only when first used
    pool = ThreadPoolExecutor(1)
    compiled: dict = {}  # key -> Future of a fresh matcher, or of None (did not compile)
    states: dict = {}  # slot -> its matcher, None, or the key of a compile not yet waited for
    buf = np.zeros((64, W), np.int32)
    eos_set = set(eos)

    def build(grammar: str):
        m = llg.LLMatcher(tok, grammar, log_level=0)
        return None if m.is_error() else m

    def get(slot: int):
        m = states.get(slot)
        if isinstance(m, _Compiling):
            fresh = compiled[m.key].result()
            m = states[slot] = fresh.deep_copy() if fresh is not None else None
        return m

    def advance(ops):
        for slot, token in ops:
            if token < 0:
                states.pop(slot, None)
                continue
            m = get(slot)
            if m is None or m.is_error():
                continue
            if token in eos_set and (m.is_stopped() or m.is_accepting()):
                continue  # the end: nothing left to match
            m.consume_token(token)  # refused: the matcher is in error, its rows EOS only

    def fill_rows(slots: list[int], rows: np.ndarray) -> None:
        base, size = rows.ctypes.data, W * 4  # (row j's address: no per-row numpy/ctypes
        for j, slot in enumerate(slots):  # objects; rows is C-contiguous)
            m = states.get(slot)
            if m is None or isinstance(m, _Compiling):
                fill_row(get(slot), rows[j])
            else:
                m.unsafe_compute_mask_ptr(base + j * size, size)

    def fill_row(m, row: np.ndarray) -> None:
        if m is None:
            row[:] = eos_words
        else:
            m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    while True:
        try:
            if spin > 0:  # decoding sends a request a step: poll for it awake, so the send
                # wakes no sleeping process (a wake-up cost 100+ us on busy hosts)
                until = time.perf_counter() + spin
                while not conn.poll(0) and time.perf_counter() < until:
                    pass
            msg = conn.recv()
        except (EOFError, OSError):
            return
        kind = msg[0]
        if kind == "new":
            _, slot, key, grammar = msg
            if key not in compiled:
                compiled[key] = pool.submit(build, grammar)
            states[slot] = _Compiling(key)
            continue
        t0 = time.perf_counter()
        half, value = msg[2], 0.0
        try:
            advance(msg[1])
            if kind in ("fill", "drafts"):
                n = len(msg[3]) if kind == "fill" else len(msg[4]) + 1
                if half >= 0:
                    rows = shared[half, :n]
                else:
                    if n > buf.shape[0]:
                        buf = np.zeros((2 * n, W), np.int32)
                    rows = buf[:n]
            if kind == "fill":
                fill_rows(msg[3], rows)
            elif kind == "drafts":
                _, _, _, slot, drafts = msg
                m = get(slot)
                rows[:] = -1
                taken = 0
                for j in range(len(drafts) + 1):
                    fill_row(m, rows[j])
                    if j == len(drafts) or m is None or m.is_error():
                        break
                    if m.is_stopped() or not m.try_consume_tokens([drafts[j]]):
                        break
                    taken += 1
                if taken:
                    m.rollback(taken)
            else:  # "accepting"
                m = get(msg[3])
                value = float(m is not None and not m.is_error() and m.is_accepting())
        except Exception as e:  # noqa: BLE001 - reported to the engine, which raises it
            conn.send_bytes(b"E" + f"{type(e).__name__}: {e}".encode())
            continue
        if kind != "accepting":
            value = time.perf_counter() - t0
        conn.send_bytes(b"K" + struct.pack("d", value))
        if kind != "accepting" and half < 0:
            conn.send_bytes(rows)


class _Compiling:
    """A state whose grammar's compile has not been waited for yet."""

    __slots__ = ("key",)

    def __init__(self, key: object) -> None:
        self.key = key


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), int(sys.argv[2]) if len(sys.argv) > 2 else None)
