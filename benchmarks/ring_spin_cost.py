"""What a worker's wait on the shared-memory ring costs: its CPU use and how late it sees a message.

    python benchmarks/ring_spin_cost.py [--messages 400] [--gap-us 1500] [--pauses 0,2e-5]

A writer (this process) puts a message every --gap-us (a decode step's pace), one reader
process (runtime/shm_broadcast.py's ShmRing, spinning as a tensor-parallel worker on a GPU
host does: spin_s = 0.05) takes them. Per pause value (the reader's pause between reads while
it spins; 0: os.sched_yield, a busy loop) it prints the reader's CPU time per wall second
(1.0: a whole core) and the delay from put() to the reader's get() returning (median, p90,
p99, microseconds), and the writer's python probe (step_phases.python_probe) while the reader
waits: a busy reader on a sibling hardware thread slows it, on a core of its own it does not.
Pin the reader off the writer's core when there are cores to spare (--reader-cpu).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time


def _reader(end, n: int, out, cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    ring = end.open()
    delays = []
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        sent = ring.get(timeout_s=30)
        delays.append(time.perf_counter() - sent)
    out.put((delays, (time.process_time() - c0) / (time.perf_counter() - w0)))
    ring.close()


def run(pause_s: float, n: int, gap_s: float, reader_cpu: int | None) -> dict:
    from layer5_parallel.bench.step_phases import python_probe
    from layer5_parallel.runtime.shm_broadcast import ShmRing

    ring = ShmRing.create(1, spin_s=0.05, pause_s=pause_s)
    out = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_reader,
                                        args=(ring.reader_end(0), n, out, reader_cpu))
    p.start()
    ring.put(time.perf_counter(), timeout_s=30)  # (the first: the reader's start-up)
    time.sleep(1.0)
    probes = []
    for i in range(n - 1):
        t = time.perf_counter() + gap_s
        if i % 8 == 4:  # the writer's own python speed while the reader waits
            probes.append(python_probe(reps=1))
        while time.perf_counter() < t:
            pass
        ring.put(time.perf_counter(), timeout_s=30)
    delays, cpu = out.get(timeout=60)
    p.join(10)
    ring.close()
    d = sorted(1e6 * x for x in delays[1:])
    return {"pause_s": pause_s, "reader_cpu_per_s": cpu, "delay_us_p50": d[len(d) // 2],
            "delay_us_p90": d[int(0.9 * len(d))], "delay_us_p99": d[int(0.99 * len(d))],
            "writer_probe_us": statistics.median(probes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=400)
    ap.add_argument("--gap-us", type=float, default=1500.0)
    ap.add_argument("--pauses", default="0,2e-5")
    ap.add_argument("--reader-cpu", type=int, default=None)
    args = ap.parse_args()
    for pause in (float(x) for x in args.pauses.split(",")):
        r = run(pause, args.messages, args.gap_us * 1e-6, args.reader_cpu)
        print(f"pause {pause * 1e6:5.1f} us: reader cpu {r['reader_cpu_per_s']:.2f} s/s, "
              f"put->get delay p50 {r['delay_us_p50']:.1f} us, p90 {r['delay_us_p90']:.1f}, "
              f"p99 {r['delay_us_p99']:.1f}; writer python probe {r['writer_probe_us']:.0f} us",
              flush=True)


if __name__ == "__main__":
    main()
