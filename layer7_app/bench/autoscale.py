"""The autoscaler under a load ramp, on CPU: replicas and TTFT as concurrency rises and falls.

    python -m layer7_app.bench.autoscale [--max-replicas 3]

Phases of c concurrent clients (each sends `per_client` streamed completions in a row), with
the router autoscaling course-model replicas between 1 and --max-replicas on requests in
flight per replica (scale up above 2). Prints each phase's TTFT p50 and the replica count
at its end, then the autoscaler's events (time, action, replicas, load that triggered it).
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import httpx

from ..router.app import start_router
from ..router.autoscale import Autoscaler

RAMP = (1, 4, 8, 8, 2, 0)


def client(url: str, n: int, ttfts: list, seed: int) -> None:
    body = {"model": "course", "prompt": "ROMEO.\n", "max_tokens": 48, "ignore_eos": True,
            "stream": True, "seed": seed}
    with httpx.Client(timeout=120) as c:
        for _ in range(n):
            start = time.perf_counter()
            with c.stream("POST", url + "/v1/completions", json=body) as resp:
                lines = resp.iter_lines()  # one iterator: a stream can be read once
                for line in lines:
                    if line.startswith("data: {"):
                        ttfts.append(time.perf_counter() - start)
                        break
                for _ in lines:
                    pass


def bench_autoscale(max_replicas: int = 3, per_client: int = 3, idle_s: float = 8.0) -> dict:
    scaler = Autoscaler("course", min_replicas=1, max_replicas=max_replicas, up_at=2.0,
                        down_at=0.5, interval=0.25, cooldown=3.0)
    phases = []
    with start_router([], autoscaler=scaler, policy="least_loaded") as router:
        for c in RAMP:
            ttfts: list = []
            if c == 0:
                time.sleep(idle_s)
            threads = [threading.Thread(target=client, args=(router.url, per_client, ttfts, i),
                                        daemon=True) for i in range(c)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(600)
            phases.append({"clients": c, "ttft_p50_ms": 1e3 * statistics.median(ttfts)
                           if ttfts else None, "replicas": len(router.replicas.replicas)})
        events = list(scaler.events)
    return {"phases": phases, "events": events}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m layer7_app.bench.autoscale")
    ap.add_argument("--max-replicas", type=int, default=3)
    args = ap.parse_args(argv)
    out = bench_autoscale(args.max_replicas)
    print("| clients | TTFT p50 | replicas after |\n| --- | --- | --- |")
    for p in out["phases"]:
        ttft = f"{p['ttft_p50_ms']:.0f} ms" if p["ttft_p50_ms"] is not None else "-"
        print(f"| {p['clients']} | {ttft} | {p['replicas']} |")
    for e in out["events"]:
        print(e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
