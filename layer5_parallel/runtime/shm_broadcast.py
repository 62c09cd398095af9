"""Rank 0 -> every worker on this host: a ring buffer of messages in shared memory.

Why: a decode step replayed from CUDA graphs costs the host a few microseconds, so how rank 0
tells its workers "run step N" matters. A pipe per worker is a pickled message and a syscall
per worker on the way out, and a wake-up (poll, then read) on the way in: tens of
microseconds each. Here rank 0 writes the message once, into shared memory, and the workers,
spinning on a flag, see it within a microsecond (vLLM's MessageQueue, nano-vllm's
SharedMemory + Event).

Layout (one SharedMemory block):

    slot s (s = message index % slots):
        seq[s]       int64   index + 1 of the message in the slot (0: never written)
        nbytes[s]    int64   its payload length
        read[s, r]   uint8   reader r has read it (the writer may reuse the slot when all have)
        data[s]      slot_bytes of payload (a pickled Python object)

The writer waits until every reader has read a slot's previous message, clears the slot's
read flags, writes the payload and its length, and only then publishes `seq` (one aligned
8-byte store; x86-64 makes stores visible to other cores in program order, so a reader that
sees the new `seq` sees the payload written before it). Reader r waits for seq[s] == its
next index + 1, copies the payload out, sets read[s, r]. `seq` counts
messages, so a slot's old message is never mistaken for its new one.

Waiting: spin (re-reading the flag) for `spin_s`, then sleep in growing naps up to 1 ms. On a
GPU host a worker spins through a whole decode step (a long nap there would delay every
rank's next launch); on a CPU, where ranks share cores, spin_s=0 naps at once. While
spinning, a reader pauses `pause_s` between reads (a short sleep, with the thread's timer
slack cut to a microsecond so that it stays short): a reader re-reading in a busy loop
(pause_s=0: os.sched_yield between reads) holds a whole core for nothing, three of them next
to the core rank 0's Python runs on (SMT siblings the guest may not see, the package's power
budget); with a 20 us pause each used 0.21-0.27 of a core on 4x H200 at the same decode step
time, since rank 0 announces a decode step before it fills the step's inputs and launches its
own graph (tp_gpu_bench --worker-pause measures both ways).
Every wait checks `alive()` (say, that the peer process still lives) each `POLL_S`, so a
dead peer turns into an error, never a hang.
"""
from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np

POLL_S = 0.5  # how often a waiting side calls alive()
MAX_NAP_S = 1e-3
PR_SET_TIMERSLACK = 29  # prctl(2)


class ShmRing:
    """One writer, `readers` readers, `slots` messages in flight of at most `slot_bytes` each.
    `ShmRing.create(...)` on the writer; `ShmRing.attach(name, reader)` in each reader (or
    pickle the reader's ring: it re-attaches by name in the receiving process)."""

    def __init__(self, shm: shared_memory.SharedMemory, readers: int, slots: int,
                 slot_bytes: int, reader: int | None, owner: bool, spin_s: float,
                 pause_s: float = 0.0) -> None:
        self.shm, self.readers, self.slots, self.slot_bytes = shm, readers, slots, slot_bytes
        self.reader, self.owner, self.spin_s, self.pause_s = reader, owner, spin_s, pause_s
        self.reader_pause_s = pause_s  # what reader_end hands the readers
        self.count = 0  # messages written (writer) or read (reader r) so far
        self.waited_s = 0.0  # time spent waiting: the writer, for a slot its readers still hold
        buf, flag_w = shm.buf, _round8(readers)
        self.seq = np.ndarray((slots,), np.int64, buf, 0)
        self.nbytes = np.ndarray((slots,), np.int64, buf, 8 * slots)
        self.read = np.ndarray((slots, flag_w), np.uint8, buf, 16 * slots)
        self.data_at = 16 * slots + slots * flag_w
        # the writer's per-message path in plain buffer operations (numpy's calls on a few
        # bytes cost microseconds each on a cold cache, as between two decode steps)
        self._flags_at = [16 * slots + s * flag_w for s in range(slots)]
        self._all_read, self._none_read = b"\x01" * readers, bytes(readers)
        self._seq_q = buf[:8 * slots].cast("q")
        self._nbytes_q = buf[8 * slots:16 * slots].cast("q")

    # ---- life -------------------------------------------------------------------------------
    @classmethod
    def create(cls, readers: int, *, slots: int = 8, slot_bytes: int = 1 << 18,
               spin_s: float = 0.0, pause_s: float = 0.0) -> ShmRing:
        """A new ring (the writer's end); `name` names it for the readers. spin_s: how long
        the writer and the readers spin; pause_s: the readers' pause while spinning (the
        writer, rank 0, yields: its waits for a slot are rare and short)."""
        if readers < 1 or slots < 1 or slot_bytes < 64:
            raise ValueError(f"need readers >= 1, slots >= 1, slot_bytes >= 64; got {readers}, "
                             f"{slots}, {slot_bytes}")
        size = 16 * slots + slots * _round8(readers) + slots * slot_bytes
        shm = shared_memory.SharedMemory(create=True, size=size)
        ring = cls(shm, readers, slots, slot_bytes, None, True, spin_s)  # (yields: rank 0)
        ring.reader_pause_s = pause_s
        ring.seq[:] = 0
        ring.read[:] = 1  # every slot free
        return ring

    @classmethod
    def attach(cls, name: str, reader: int, readers: int, slots: int, slot_bytes: int,
               spin_s: float = 0.0, pause_s: float = 0.0, *, untrack: bool = False) -> ShmRing:
        """Reader `reader` (0-based) of the ring called `name`. untrack: a process that does
        not share the writer's resource tracker (not started by it through multiprocessing)
        must not let its tracker remove the block at its exit."""
        if not 0 <= reader < readers:
            raise ValueError(f"reader must be in [0, {readers}), got {reader}")
        shm = shared_memory.SharedMemory(name=name)
        if untrack:
            _untrack(shm)
        if pause_s > 0:
            tight_timer_slack()
        return cls(shm, readers, slots, slot_bytes, reader, False, spin_s, pause_s)

    @property
    def name(self) -> str:
        return self.shm.name

    def reader_end(self, reader: int, spin_s: float | None = None,
                   pause_s: float | None = None) -> _ReaderEnd:
        """A picklable handle that becomes reader `reader`'s ring in the process it is sent to."""
        return _ReaderEnd(self.name, reader, self.readers, self.slots, self.slot_bytes,
                          self.spin_s if spin_s is None else spin_s,
                          self.reader_pause_s if pause_s is None else pause_s)

    def close(self) -> None:
        """Detach (and, on the writer, remove the block). Views die first: numpy holds buf."""
        self.seq = self.nbytes = self.read = None
        for view in (self._seq_q, self._nbytes_q):
            if view is not None:
                view.release()
        self._seq_q = self._nbytes_q = None
        try:
            self.shm.close()
        except BufferError:  # a view still alive somewhere: leave it to the process's exit
            pass
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
            self.owner = False

    # ---- writer -----------------------------------------------------------------------------
    def put(self, obj, *, timeout_s: float, alive: Callable[[], None] | None = None) -> None:
        """Publish obj (pickled; a `Pickled` as it is) to every reader. Waits at most timeout_s
        for the slot's old message to be read by all (TimeoutError naming the readers that
        have not)."""
        data = obj if type(obj) is Pickled else pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
        if len(data) > self.slot_bytes:
            raise ValueError(f"a {len(data)}-byte message does not fit a {self.slot_bytes}-byte "
                             "slot of the shared-memory ring")
        s, buf = self.count % self.slots, self.shm.buf
        at, n = self._flags_at[s], self.readers
        if buf[at:at + n] != self._all_read:
            flags = self.read[s, :n]
            self._wait(lambda: bool(flags.all()), timeout_s, alive, lambda: (
                f"reader(s) {[r for r in range(n) if not flags[r]]} did not take "
                f"message {self.count - self.slots} within {timeout_s:g} s"))
        buf[at:at + n] = self._none_read
        at = self.data_at + s * self.slot_bytes
        buf[at:at + len(data)] = data
        self._nbytes_q[s] = len(data)
        self.count += 1
        self._seq_q[s] = self.count  # publish last (one aligned 8-byte store)

    # ---- reader -----------------------------------------------------------------------------
    def poll(self, timeout_s: float) -> bool:
        """True if the next message is there, waiting at most timeout_s (no alive checks)."""
        s, want, seq = self.count % self.slots, self.count + 1, self._seq_q
        if seq[s] == want:
            return True
        try:
            self._wait(lambda: seq[s] == want, timeout_s, None, lambda: "")
        except TimeoutError:
            return False
        return True

    def get(self, *, timeout_s: float | None = None, alive: Callable[[], None] | None = None):
        """The next message (unpickled); waits at most timeout_s (None: for ever, calling
        alive() every POLL_S)."""
        s, want, seq = self.count % self.slots, self.count + 1, self._seq_q
        if seq[s] != want:
            self._wait(lambda: seq[s] == want, timeout_s, alive,
                       lambda: f"no message {self.count} within {timeout_s:g} s")
        buf, at = self.shm.buf, self.data_at + s * self.slot_bytes
        data = bytes(buf[at:at + self._nbytes_q[s]])
        buf[self._flags_at[s] + self.reader] = 1
        self.count += 1
        return pickle.loads(data)

    # ---- waiting ----------------------------------------------------------------------------
    def _wait(self, ready: Callable[[], bool], timeout_s: float | None,
              alive: Callable[[], None] | None, what: Callable[[], str]) -> None:
        start = time.monotonic()
        spin_until, next_check, nap = start + self.spin_s, start + POLL_S, 2e-5
        try:
            while not ready():
                now = time.monotonic()
                if timeout_s is not None and now - start > timeout_s:
                    raise TimeoutError(what())
                if now >= next_check:
                    next_check = now + POLL_S
                    if alive is not None:
                        alive()
                if now < spin_until:
                    if self.pause_s > 0:
                        time.sleep(self.pause_s)
                    else:
                        os.sched_yield()
                else:
                    time.sleep(nap)
                    nap = min(2 * nap, MAX_NAP_S)
        finally:
            self.waited_s += time.monotonic() - start


class Pickled(bytes):
    """A message pickled once, ahead (one sent every step, e.g. "replay graph B"): put()
    writes it as it is; the readers get the object back."""

    @classmethod
    def of(cls, obj) -> Pickled:
        return cls(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))


class _ReaderEnd:
    """Reader r's end in transit: unpickles into ShmRing.attach(...) in the receiver."""

    def __init__(self, name: str, reader: int, readers: int, slots: int, slot_bytes: int,
                 spin_s: float, pause_s: float = 0.0) -> None:
        self.args = (name, reader, readers, slots, slot_bytes, spin_s, pause_s)

    def open(self) -> ShmRing:
        return ShmRing.attach(*self.args)


class RingConn:
    """A worker's control channel: messages from rank 0 arrive through the shared-memory ring
    (poll/recv), replies go back through the worker's pipe (send). It stands where a worker
    used a duplex Pipe end, so a worker loop reads it unchanged."""

    def __init__(self, pipe, ring: _ReaderEnd | ShmRing) -> None:
        self.pipe, self._ring = pipe, ring

    @property
    def ring(self) -> ShmRing:
        if isinstance(self._ring, _ReaderEnd):  # first use in the worker: attach
            self._ring = self._ring.open()
        return self._ring

    def poll(self, timeout_s: float = 0.0) -> bool:
        return self.ring.poll(timeout_s)

    def recv(self):
        return self.ring.get(timeout_s=None)

    def send(self, msg) -> None:
        self.pipe.send(msg)

    def close(self) -> None:
        self.pipe.close()
        if isinstance(self._ring, ShmRing):
            self._ring.close()


def tight_timer_slack(ns: int = 1000) -> bool:
    """This thread's timer slack (how late the kernel may end a sleep to batch wake-ups;
    50 us by default) cut to `ns`, so a short pause between polls stays short (Linux; False
    elsewhere or if refused)."""
    try:
        import ctypes  # noqa: PLC0415
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _round8(n: int) -> int:
    return -(-n // 8) * 8


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Forget an attached block in this process's resource tracker (Python < 3.13 registers
    every attach and would unlink the writer's block at this process's exit)."""
    try:
        from multiprocessing import resource_tracker
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    except Exception:  # noqa: BLE001 - best effort: at worst a warning at exit
        pass
