"""The end of benchmarks/collectives_gpu.sh: one compact table from what the session wrote.

    python benchmarks/collectives_summary.py RESULTS_DIR [PYTEST_LOG]

RESULTS_DIR holds bench.json (`stack bench --layer 2 --out`) and, if the tuning grid ran,
tune.json (`python -m layer2_comm.commands tune --out`). Prints: ours vs torch.distributed
at a few sizes per collective with the target (>= 0.85x busbw at 256 MiB), the
alpha-beta fit, the overlap efficiencies (target >= 70% of the communication hidden), the
tuning grid's best settings and the header check's cost, and the multi-GPU tests' verdict.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGET_BYTES = 256 << 20
TARGET_RATIO = 0.85
TARGET_OVERLAP = 0.70
SHOWN = (8, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if nbytes == int(nbytes) else f"{nbytes:.3g} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}" if seconds >= 1e-4 else f"{seconds * 1e6:.1f}"


def _pairs(rows: list[dict]) -> dict[tuple[str, int], tuple[dict, dict]]:
    """(collective, bytes) -> (ours, built-in) for the ring algorithms of the sweep."""
    theirs = {(r["collective"], r["bytes"]): r for r in rows if r["impl"] == "torch"}
    return {
        (r["collective"], r["bytes"]): (r, theirs[r["collective"], r["bytes"]])
        for r in rows
        if r["impl"] == "ours"
        and r["algorithm"].startswith("ring_")
        and (r["collective"], r["bytes"]) in theirs
    }


def _target_size(sizes: list[int]) -> int:
    """256 MiB, or on a small run (CPU) the largest size up to it."""
    below = [b for b in sizes if b <= TARGET_BYTES]
    return max(below) if below else min(sizes)


def bench_lines(record: dict) -> list[str]:
    pairs = _pairs(record["rows"])
    lines = [
        f"{record['world']} ranks x {record['device']}, {record['backend']}, "
        f"torch {record['torch']}, "
        f"NCCL {record['nccl']}, {record['date']}",
        f"{'collective':<15}{'size':>9}{'ours us':>11}{'torch us':>11}{'ours busbw':>12}"
        f"{'torch busbw':>12}{'ratio':>7}  (busbw GB/s)",
    ]
    verdicts = []
    for collective in COLLECTIVES:
        sizes = sorted(b for c, b in pairs if c == collective)
        if not sizes:
            continue
        target = _target_size(sizes)
        shown = sorted({b for b in sizes if b in SHOWN} | {target, sizes[-1]})
        for b in shown:
            ours, theirs = pairs[collective, b]
            ratio = ours["busbw"] / theirs["busbw"] if theirs["busbw"] else float("nan")
            flag = "" if ours["ok"] and theirs["ok"] else "  WRONG RESULT"
            if b == target:
                met = ratio >= TARGET_RATIO
                flag += f"  <- target >= {TARGET_RATIO}x: {'met' if met else 'NOT met'}"
                verdicts.append(f"{collective} {ratio:.2f}x at {human(b)}")
            lines.append(
                f"{collective:<15}{human(b):>9}{_us(ours['time_s']):>11}{_us(theirs['time_s']):>11}"
                f"{ours['busbw'] / 1e9:>12.1f}{theirs['busbw'] / 1e9:>12.1f}{ratio:>7.2f}{flag}"
            )
    lines.append("ours / built-in busbw: " + ", ".join(verdicts))
    alpha, beta = record["alpha_s"], record["beta_s_per_byte"]
    lines.append(
        f"alpha-beta (ping-pong 0<->1): alpha {alpha * 1e6:.1f} us, "
        + (f"1/beta {1 / beta / 1e9:.1f} GB/s" if beta else "beta 0")
        + f"; ring/tree crossover predicted {record['crossover_predicted_bytes']}, "
        f"measured {record['crossover_measured_bytes']}"
    )
    model = {(p["algorithm"], p["bytes"]): p["time_s"] for p in record.get("predicted", [])}
    ring = sorted(
        (r["bytes"], r["time_s"]) for r in record["rows"] if r["algorithm"] == "ring_all_reduce"
    )
    if ring and model.get(("ring_all_reduce", ring[-1][0])):
        b, t = ring[-1]
        lines.append(
            f"ring all-reduce at {human(b)}: measured / alpha-beta predicted = "
            f"{t / model['ring_all_reduce', b]:.2f}"
        )
    return lines


def overlap_lines(o: dict | None) -> list[str]:
    if not o:
        return ["overlap: not measured"]
    lines = [
        f"overlap ({human(o['comm_bytes'])} all-reduce vs {o['matmul_n']}^2 "
        f"{o['matmul_dtype']} matmuls; "
        f"share of comm hidden = (t_comp + t_comm - t_both) / min(t_comp, t_comm)); "
        f"results {'correct' if o['correct'] else 'WRONG'}"
    ]
    for name, key in (
        ("async handle", ""),
        ("side stream", "side_stream_"),
        ("lean CTAs", "lean_"),
    ):
        eff = o.get(f"{key}efficiency")
        if eff is None:
            continue
        comm = o.get(f"{key}t_comm_s", o["t_comm_s"])
        comp = o.get(f"{key}t_comp_s", o["t_comp_s"])
        both = o.get(f"{key}t_both_s", o.get("t_both_side_stream_s"))
        extra = f" (<= {o['lean_ctas']} CTAs of {o.get('sms', '?')} SMs)" if key == "lean_" else ""
        lines.append(
            f"  {name:<13} comm {_us(comm)} us, compute {_us(comp)} us, both {_us(both)} us: "
            f"{eff:.0%} hidden{extra}  [target >= {TARGET_OVERLAP:.0%}: "
            f"{'met' if eff >= TARGET_OVERLAP else 'NOT met'}]"
        )
    return lines


def tune_lines(tune: dict | None) -> list[str]:
    if not tune:
        return ["tuning grid: not run"]
    d = tune["defaults"]
    lines = [f"tuning (defaults: lanes={d['lanes']}, pieces of {human(d['chunk_bytes'])}):"]
    biggest = max(r["bytes"] for r in tune["steps"])
    lines.append(
        "  one ring step, "
        + human(biggest)
        + " each way: "
        + ", ".join(
            f"{r['lanes']} lane(s) {r['bytes_per_s'] / 1e9:.1f} GB/s"
            for r in tune["steps"]
            if r["bytes"] == biggest
        )
    )
    ref = {(r["collective"], r["bytes"]): r for r in tune["reference"]}
    for key in sorted({(r["collective"], r["bytes"]) for r in tune["configs"]}):
        rows = [r for r in tune["configs"] if (r["collective"], r["bytes"]) == key and r["ok"]]
        t = ref.get(key)
        if not rows or not t or not t["busbw"]:
            continue
        best = max(rows, key=lambda r: r["busbw"])
        default = next(
            (r for r in rows if r["lanes"] == d["lanes"] and r["chunk_bytes"] == d["chunk_bytes"]),
            None,
        )
        chunk = (
            "whole segments"
            if best["chunk_bytes"] is None
            else f"pieces of {human(best['chunk_bytes'])}"
        )
        lines.append(
            f"  {key[0]:<15}{human(key[1]):>9}: best {best['busbw'] / t['busbw']:.2f}x "
            f"(lanes={best['lanes']}, {chunk}, host {_us(best['host_s'])} us "
            f"vs GPU {_us(best['time_s'])} us)"
            + (f"; default {default['busbw'] / t['busbw']:.2f}x" if default else "")
        )
    by: dict[int, dict] = {}
    for r in tune["check"]:
        by.setdefault(r["bytes"], {})[
            "torch" if r["impl"] == "torch" else ("on" if r["check"] else "off")
        ] = r["time_s"]
    lines.append(
        "  header check, all-reduce us: "
        + "; ".join(
            f"{human(b)} on {_us(v['on'])} / off {_us(v['off'])} / built-in {_us(v['torch'])}"
            for b, v in sorted(by.items())
            if {"on", "off", "torch"} <= set(v)
        )
    )
    return lines


def pytest_lines(log: Path | None) -> list[str]:
    if log is None or not log.exists():
        return ["pytest -m multigpu: not run"]
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    words = (" passed", " failed", " error", " skipped", " deselected", "no tests ran")
    verdicts = [line.strip("= ") for line in lines if any(w in line for w in words)]
    code = [line for line in lines if line.startswith("pytest exit code")]
    return [
        "pytest -m multigpu tests/layer2: "
        + (verdicts[-1] if verdicts else "no verdict line")
        + (f" ({code[-1]})" if code else "")
    ]


def summarize(folder: Path, pytest_log: Path | None = None) -> str:
    folder = Path(folder)
    bench, tune = folder / "bench.json", folder / "tune.json"
    lines = ["=" * 30 + " layer 2 session summary " + "=" * 30]
    lines += pytest_lines(pytest_log)
    if bench.exists():
        record = json.loads(bench.read_text())
        lines += bench_lines(record)
        lines += overlap_lines(record.get("overlap"))
    else:
        lines.append(f"no {bench}: the sweep did not finish (see bench.log)")
    lines += tune_lines(json.loads(tune.read_text()) if tune.exists() else None)
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    print(summarize(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) == 3 else None))
