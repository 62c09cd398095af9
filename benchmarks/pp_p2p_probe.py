"""Two questions about the pipeline's NCCL hand-offs, asked of two GPUs without the engine.

1. Order: can the pipeline's p2p order deadlock? A step with 2 micro-batches posts, on one
   process group (so, under NCCL, one communicator and one stream for the pair of ranks):
       rank 0 (stage 0):  send x0, send x1, recv logits0, recv logits1
       rank 1 (stage 1):  recv x0, send logits0, recv x1, send logits1
   Rank 0's `send x1` and rank 1's `send logits0` are in flight at once, each ahead of the
   other rank's matching recv on its stream. NCCL can finish a send only as far as its
   buffers hold it before the peer posts the recv, so when both messages are larger than that
   the two ranks wait on each other for ever (gloo's sends never wait like that: the CPU
   tests cannot see it). Run here with the stream (x) and the logits at several sizes, on one
   group ("one") and with the logits on a second group of their own ("two": a second
   communicator, a second stream). A case that hangs is reported after --hang-s.
2. Waiting: what `work.wait(timeout)` (what stage._wait does) costs against `work.wait()`.
   With a timeout, torch's WorkNCCL::wait blocks the host until the transfer is done, polling
   with short sleeps; without one only the current stream waits. A 1 MiB ping-pong, both ways.

    python3 benchmarks/pp_p2p_probe.py --out $OUT    # 2 GPUs: NCCL
    python3 benchmarks/pp_p2p_probe.py --out /tmp/p  # no 2 GPUs: gloo on the CPU (a dry run)

Each case runs in fresh processes (a hung NCCL communicator cannot be reused), killed past
--hang-s + 30 s. Results: $OUT/pp_p2p_probe.json, and a line per case on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MiB = 1 << 20


def _group(rank: int, store, backend: str, prefix: str, timeout_s: float):
    """A process group of the two ranks of its own (its own NCCL communicator) over `store`."""
    store = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(store, rank, 2, opts)


def _order(rank: int, fwd, back, x_bytes: int, l_bytes: int, dev, hang_s: float) -> float:
    """The pipeline's order for one 2-micro-batch step; returns seconds (rank 0 waits)."""
    x = [torch.full((x_bytes // 2,), float(i + 1), dtype=torch.bfloat16, device=dev)
         for i in range(2)]
    logit = [torch.full((l_bytes // 4,), float(i + 1), dtype=torch.float32, device=dev)
             for i in range(2)]
    start, works = time.perf_counter(), []
    if rank == 0:
        works += [fwd.send([x[0]], 1, 0), fwd.send([x[1]], 1, 1)]
        works += [back.recv([logit[0]], 1, 0), back.recv([logit[1]], 1, 1)]
    else:
        works.append(fwd.recv([x[0]], 0, 0))
        works.append(back.send([logit[0]], 0, 0))
        works.append(fwd.recv([x[1]], 0, 1))
        works.append(back.send([logit[1]], 0, 1))
    for w in works:
        w.wait(timeout=timedelta(seconds=hang_s))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - start


def _pingpong(rank: int, pg, dev, n: int, with_timeout: bool) -> float:
    """Seconds per round trip of a 1 MiB message (rank 0 -> 1 -> 0), n times."""
    buf = torch.zeros(MiB // 4, dtype=torch.float32, device=dev)

    def wait(w) -> None:
        if with_timeout:
            w.wait(timeout=timedelta(seconds=60))
        else:
            w.wait()

    for it in range(n + 5):
        if it == 5:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            start = time.perf_counter()
        if rank == 0:
            wait(pg.send([buf], 1, 0))
            wait(pg.recv([buf], 1, 0))
        else:
            wait(pg.recv([buf], 0, 0))
            buf.add_(1.0)  # a kernel between the hand-offs, as a stage's compute
            wait(pg.send([buf], 0, 0))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return (time.perf_counter() - start) / n


def _rank(rank: int, port: int, backend: str, case: dict, hang_s: float, q) -> None:
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                              timeout=timedelta(seconds=hang_s + 30))
        fwd = _group(rank, store, backend, "fwd", hang_s + 30)
        if case["kind"] == "order":
            back = _group(rank, store, backend, "back", hang_s + 30) if case["groups"] == 2 else fwd
            _order(rank, fwd, back, 64 * 1024, 64 * 1024, dev, hang_s)  # warm-up: comms made
            secs = _order(rank, fwd, back, case["x_bytes"], case["l_bytes"], dev, hang_s)
        else:
            secs = _pingpong(rank, fwd, dev, case["n"], case["timeout"])
        q.put((rank, "ok", secs))
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which names the case
        q.put((rank, "error", f"{type(exc).__name__}: {str(exc)[:300]}"))
    q.close()
    q.join_thread()  # the answer is out (os._exit skips the queue's flush)
    sys.stdout.flush()
    os._exit(0)  # a hung communicator must not hold the process in its teardown


def run_case(case: dict, backend: str, hang_s: float) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, backend, case, hang_s, q), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + hang_s + 60
    while len(got) < 2 and time.monotonic() < deadline:
        try:
            r, status, val = q.get(timeout=1.0)
            got[r] = (status, val)
        except Exception:  # noqa: BLE001 - queue.Empty: keep waiting until the deadline
            if not any(p.is_alive() for p in procs) and q.empty():
                break
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(5.0)
    row = dict(case)
    if len(got) < 2 or any(s != "ok" for s, _ in got.values()):
        row["result"] = "hang or error"
        row["detail"] = {r: v for r, (s, v) in got.items()} or "no rank answered"
    else:
        row["result"] = "ok"
        row["seconds"] = max(v for _, v in got.values())
    return row


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/pp_p2p_probe"))
    ap.add_argument("--hang-s", type=float, default=15.0,
                    help="how long a case may wait before it counts as hung")
    args = ap.parse_args()
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = [{"kind": "pingpong", "timeout": t, "n": 200} for t in (True, False)]
    # x: a micro-batch's stream (2 * rows * hidden * 2 bytes; 1B shape, 128 rows: 1 MiB,
    # 1024 rows: 8 MiB; 8B shape, 1024 rows: 16 MiB); logits: rows * 128256 * 4 bytes (128
    # rows: 63 MiB). Past what NCCL buffers (a few MiB a channel) both sides wait.
    for x, lg in ((1 * MiB, 2 * MiB), (1 * MiB, 64 * MiB), (8 * MiB, 2 * MiB),
                  (8 * MiB, 64 * MiB), (32 * MiB, 64 * MiB)):
        cases += [{"kind": "order", "groups": g, "x_bytes": x, "l_bytes": lg} for g in (1, 2)]
    rows = []
    print(f"backend {backend}, torch {torch.__version__}"
          + (f", {torch.cuda.get_device_name(0)}" if backend == "nccl" else ""), flush=True)
    for case in cases:
        row = run_case(case, backend, args.hang_s)
        rows.append(row)
        if case["kind"] == "pingpong":
            what = f"1 MiB ping-pong, wait({'timeout' if case['timeout'] else ''})"
        else:
            what = (f"order, {case['groups']} group(s), x {case['x_bytes'] // MiB} MiB, "
                    f"logits {case['l_bytes'] // MiB} MiB")
        res = (f"{row['seconds'] * 1e6:,.0f} us" if row["result"] == "ok"
               else f"HANG/ERROR {row['detail']}")
        print(f"  {what}: {res}", flush=True)
    (out / "pp_p2p_probe.json").write_text(json.dumps(
        {"backend": backend, "torch": torch.__version__, "rows": rows}, indent=1, default=str))
    print(f"wrote {out / 'pp_p2p_probe.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
