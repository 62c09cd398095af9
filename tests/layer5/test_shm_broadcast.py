"""The shared-memory ring rank 0 hands each step to its workers through: every reader gets
every message in order (also when the writer laps the ring), the writer waits for slow
readers and names a reader that never reads, and a message too big for a slot is refused."""
from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from layer5_parallel.runtime.shm_broadcast import Pickled, RingConn, ShmRing


def _reader(end, pipe, n: int) -> None:
    conn = RingConn(pipe, end)
    got = []
    for _ in range(n):
        assert conn.poll(30.0)
        got.append(conn.recv())
        if len(got) % 7 == 0:
            time.sleep(0.01)  # a slow reader: the writer must wait for it, not overwrite
    conn.send(got)


@pytest.mark.parametrize("pause_s", [0.0, 2e-5])
def test_every_reader_gets_every_message_in_order(pause_s):
    """Readers spinning (a GPU host's workers), yielding or pausing between reads."""
    ring = ShmRing.create(2, slots=4, slot_bytes=4096, spin_s=0.05, pause_s=pause_s)
    assert ring.reader_end(1).args[-2:] == (0.05, pause_s) and ring.pause_s == 0.0
    ctx = mp.get_context("spawn")
    msgs = [("step", i, list(range(i % 50))) for i in range(60)]
    procs, pipes = [], []
    for r in range(2):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_reader, args=(ring.reader_end(r), theirs, len(msgs)), daemon=True)
        p.start()
        procs.append(p)
        pipes.append(mine)
    try:
        for m in msgs:
            ring.put(m, timeout_s=30.0)
        for pipe in pipes:
            assert pipe.poll(60.0)
            assert pipe.recv() == msgs
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        ring.close()
    assert all(p.exitcode == 0 for p in procs)


def test_writer_names_a_reader_that_does_not_read():
    ring = ShmRing.create(2, slots=2, slot_bytes=256)
    reader0 = ShmRing.attach(ring.name, 0, 2, 2, 256)
    try:
        for i in range(2):
            ring.put(i, timeout_s=1.0)
        assert reader0.get(timeout_s=1.0) == 0
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"reader\(s\) \[0, 1\]|reader\(s\) \[1\]"):
            ring.put(2, timeout_s=0.3)
        assert time.monotonic() - start < 5.0
        assert 0.3 <= ring.waited_s < 5.0  # the writer's waits are counted (host-time reports)
        with pytest.raises(RuntimeError, match="peer gone"):  # alive() turns a wait into an error
            ring.put(2, timeout_s=30.0, alive=_gone)
    finally:
        reader0.close()
        ring.close()


def _gone() -> None:
    raise RuntimeError("peer gone")


def test_message_too_big_for_a_slot_is_refused():
    ring = ShmRing.create(1, slots=2, slot_bytes=128)
    try:
        with pytest.raises(ValueError, match="does not fit"):
            ring.put(b"x" * 1000, timeout_s=1.0)
        reader = ShmRing.attach(ring.name, 0, 1, 2, 128)
        assert not reader.poll(0.01)
        ring.put("small", timeout_s=1.0)
        assert reader.poll(0.0) and reader.get() == "small"
        reader.close()
    finally:
        ring.close()


def test_a_message_pickled_ahead_arrives_as_its_object():
    """Rank 0 pickles its per-step message once (Pickled) and puts the same bytes every step;
    readers get the object, in order with the others, also when the writer laps the ring."""
    ring = ShmRing.create(1, slots=2, slot_bytes=256)
    reader = ShmRing.attach(ring.name, 0, 1, 2, 256)
    try:
        msg = Pickled.of(("graph", 8))
        for i in range(5):
            ring.put(msg, timeout_s=1.0)
            ring.put(("step", [i]), timeout_s=1.0)
            assert reader.get(timeout_s=1.0) == ("graph", 8)
            assert reader.get(timeout_s=1.0) == ("step", [i])
        assert ring.count == reader.count == 10
    finally:
        reader.close()
        ring.close()
