"""The worker process's side of mask_worker.py: run as a script (`python mask_worker_serve.py
FD`, FD its end of a socket), with the standard library, numpy and llguidance only (no torch,
no layer imports: it starts in a fraction of a second). It holds the engine's constrained
sequences' grammars by slot and answers, in order:

    ("init", tokenizer_json, V, eos)      the vocabulary, once
    ("new", slot, key, grammar)           a state; its grammar compiled on a thread (cached
                                          by key), waited for when the state is first used
    ("fill", ops, slots)                  ops: (slot, token) advances, (slot, -1) frees, in
                                          order; then row j <- slots[j]'s allowed next tokens:
                                          replies ("ok", seconds) and the (R, W) int32 bytes
    ("drafts", ops, slot, drafts)         the rows of GrammarState.fill_drafts (rolled back)
    ("accepting", ops, slot)              ("ok", whether the text so far is a full match)

An error is answered ("error", message) instead; the engine raises it. EOF on the socket (the
engine closed it, or died) ends the process.
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import numpy as np


def serve(conn: Connection) -> None:
    import llguidance as llg

    _, tokenizer_json, vocab_size, eos = conn.recv()
    tok = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)
    W = (vocab_size + 31) // 32
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

    def fill_row(m, row: np.ndarray) -> None:
        if m is None:
            row[:] = eos_words
        else:
            m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    while True:
        try:
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
        try:
            advance(msg[1])
            if kind == "fill":
                slots = msg[2]
                if len(slots) > buf.shape[0]:
                    buf = np.zeros((2 * len(slots), W), np.int32)
                rows = buf[:len(slots)]
                for j, slot in enumerate(slots):
                    fill_row(get(slot), rows[j])
            elif kind == "drafts":
                _, _, slot, drafts = msg
                m = get(slot)
                rows = np.full((len(drafts) + 1, W), -1, np.int32)
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
                m = get(msg[2])
                conn.send(("ok", m is not None and not m.is_error() and m.is_accepting()))
                continue
        except Exception as e:  # noqa: BLE001 - reported to the engine, which raises it
            conn.send(("error", f"{type(e).__name__}: {e}"))
            continue
        conn.send(("ok", time.perf_counter() - t0))
        conn.send_bytes(rows)


class _Compiling:
    """A state whose grammar's compile has not been waited for yet."""

    __slots__ = ("key",)

    def __init__(self, key: object) -> None:
        self.key = key


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
