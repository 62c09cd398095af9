"""Two tp_gpu_bench runs side by side (e.g. the default path and the same bench with a switch
on, run one after the other on one machine): per shape, TP size and batch, tokens/s, the
speed-up over the same run's TP=1 and the step time, before and after.

    python benchmarks/tp_ab_summary.py BEFORE/tp_gpu.json AFTER/tp_gpu.json [--names off,on]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows_by_key(path: str) -> dict:
    data = json.loads(Path(path).read_text())
    return {(r["shape"], r["tp"], r["batch"]): r for r in data["rows"]}, data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--names", default="before,after")
    args = ap.parse_args(argv)
    a, da = rows_by_key(args.before)
    b, db = rows_by_key(args.after)
    na, nb = args.names.split(",")
    print(f"{da.get('device')} x {da.get('gpus')} ({na}) / {db.get('device')} x {db.get('gpus')} "
          f"({nb}), torch {da.get('torch')}")
    print(f"{'shape':14} {'tp':>2} {'B':>3} | {na + ' tok/s':>12} {'x TP1':>6} {'step ms':>8} | "
          f"{nb + ' tok/s':>12} {'x TP1':>6} {'step ms':>8} | {'after/before':>12}")
    for key in sorted(set(a) & set(b)):
        ra, rb = a[key], b[key]
        print(f"{key[0]:14} {key[1]:>2} {key[2]:>3} | {ra['decode_tok_s']:>12,.0f} "
              f"{ra.get('speedup', float('nan')):>6.2f} {ra['step_ms']:>8.3f} | "
              f"{rb['decode_tok_s']:>12,.0f} {rb.get('speedup', float('nan')):>6.2f} "
              f"{rb['step_ms']:>8.3f} | {rb['decode_tok_s'] / ra['decode_tok_s']:>12.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
