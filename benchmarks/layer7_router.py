"""Layer 7's router benchmarks on this machine (CPU is enough): prefix_aware vs round_robin
on a multi-turn chat workload, then the autoscaler under a load ramp. Prints Markdown tables
(recorded in BENCHMARKS.md and layer7_app/README.md).

    python benchmarks/layer7_router.py [--replicas 3]
"""
from __future__ import annotations

import argparse

from layer7_app.bench import autoscale as bench_autoscale
from layer7_app.bench import router as bench

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=3)
    args = ap.parse_args()
    bench.main(["--replicas", str(args.replicas), "--conversations", "6", "--turns", "5"])
    bench_autoscale.main(["--max-replicas", str(args.replicas)])
