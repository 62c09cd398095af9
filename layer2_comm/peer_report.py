"""The peer all-reduce benchmark, presented: latency and choice tables, busbw plot, markdown."""
from __future__ import annotations

import math
from pathlib import Path

from rich.table import Table

from .plots import _save, human, plt

ORDER = ("ours (by size)", "ours one_shot", "ours two_shot", "NCCL", "torch symm_mem one_shot",
         "torch symm_mem two_shot")


GATHER_SCATTER = ("ours all_gather", "NCCL all_gather", "ours reduce_scatter",
                  "NCCL reduce_scatter")


def _us(t: float) -> str:
    return "-" if not t == t else f"{t * 1e6:.1f}"


def _by_size(rows: list[dict]) -> dict[int, dict[str, dict]]:
    table: dict[int, dict[str, dict]] = {}
    for r in rows:
        table.setdefault(r["bytes"], {})[r["impl"]] = r
    return dict(sorted(table.items()))


def latency_table(rows: list[dict]) -> Table:
    """Median time per call (us) per size and contender, and ours vs NCCL / torch two-shot."""
    table = Table(title="all-reduce time per call (us; CUDA-graph replays up to 8 MiB, eager "
                        "above), median of the slowest rank; ok = equals NCCL exactly")
    table.add_column("size", justify="right")
    impls = [i for i in ORDER if any(r["impl"] == i for r in rows)]
    for impl in impls:
        table.add_column(impl, justify="right")
    for column in ("NCCL / ours", "torch 2-shot / ours", "busbw ours GB/s", "ok"):
        table.add_column(column, justify="right")
    for size, per in _by_size([r for r in rows if r["impl"] in ORDER]).items():
        ours = per.get("ours (by size)", {}).get("time_s", math.nan)
        nccl = per.get("NCCL", {}).get("time_s", math.nan)
        torch2 = per.get("torch symm_mem two_shot", {}).get("time_s", math.nan)
        ok = all(r["ok"] for k, r in per.items() if k.startswith("ours") or k == "NCCL")
        table.add_row(human(size), *[_us(per.get(i, {}).get("time_s", math.nan)) for i in impls],
                      f"{nccl / ours:.2f}x", f"{torch2 / ours:.2f}x" if torch2 == torch2 else "-",
                      f"{per.get('ours (by size)', {}).get('busbw', math.nan) / 1e9:.1f}",
                      "[green]yes" if ok else "[red]NO")
    return table


def gather_scatter_table(rows: list[dict]) -> Table:
    """All-gather and reduce-scatter, ours (peer memory) vs NCCL: time and busbw."""
    table = Table(title="all-gather / reduce-scatter through peer memory vs NCCL (CUDA graphs up "
                        "to 8 MiB, eager above; median of the slowest rank)")
    for column in ("collective", "size", "ours us", "NCCL us", "ours busbw GB/s",
                   "NCCL busbw GB/s", "ours / NCCL busbw", "ok"):
        table.add_column(column, justify="right")
    for kind in ("all_gather", "reduce_scatter"):
        ours = {r["bytes"]: r for r in rows if r["impl"] == f"ours {kind}"}
        nccl = {r["bytes"]: r for r in rows if r["impl"] == f"NCCL {kind}"}
        for size in sorted(set(ours) & set(nccl)):
            o, n = ours[size], nccl[size]
            table.add_row(kind, human(size), _us(o["time_s"]), _us(n["time_s"]),
                          f"{o['busbw'] / 1e9:.0f}", f"{n['busbw'] / 1e9:.0f}",
                          f"{o['busbw'] / n['busbw']:.2f}x", "[green]yes" if o["ok"] else "[red]NO")
    return table


def knob_lines(rows: list[dict]) -> list[str]:
    """The knob sweep (bench_peer.KNOBS) as markdown: one row per size and algorithm, one
    column per knob (us per call; NCCL's and torch two-shot's time at that size beside)."""
    knobs = [r for r in rows if r["impl"].startswith("knob ")]
    if not knobs:
        return []
    names = list(dict.fromkeys(r["knob"] for r in knobs))
    ref = {(r["bytes"], r["impl"]): r["time_s"] for r in rows if r["impl"] in ORDER}
    lines = ["| size | algorithm | active blocks | " + " | ".join(f"{k} (us)" for k in names)
             + " | NCCL (us) | torch 2-shot (us) |", "| --- " * (len(names) + 5) + "|"]
    cases = list(dict.fromkeys((r["bytes"], r["algorithm"]) for r in knobs))
    for size, algo in cases:
        per = {r["knob"]: r for r in knobs if r["bytes"] == size and r["algorithm"] == algo}
        cells = []
        for k in names:
            r = per.get(k)
            cells.append("-" if r is None else (_us(r["time_s"]) + ("" if r["ok"] else " (WRONG)")
                                               if r["error"] is None else "error"))
        active = per.get("defaults", {}).get("active")
        lines.append(f"| {human(size)} | {algo} | {active if active is not None else '-'} | "
                     + " | ".join(cells) + f" | {_us(ref.get((size, 'NCCL'), math.nan))} | "
                     f"{_us(ref.get((size, 'torch symm_mem two_shot'), math.nan))} |")
    errors = [f"- knob {r['knob']} {r['algorithm']} {human(r['bytes'])}: {r['error']}"
              for r in knobs if r["error"]]
    return lines + errors


def choice_table(summary: dict) -> Table:
    table = Table(title="choice by size: what PeerAllReduce.algorithm picks, what was fastest, "
                        "and the alpha-beta model's times (us)")
    for column in ("size", "chosen", "fastest measured", "one_shot", "two_shot", "nccl",
                   "model one", "model two", "model nccl"):
        table.add_column(column, justify="right")
    for row in summary["choice"]:
        p = row["predicted"]
        table.add_row(human(row["bytes"]), row["chosen"], row["fastest"],
                      *[_us(row.get(k, math.nan)) for k in ("one_shot", "two_shot", "nccl")],
                      *[_us(p[k]) for k in ("one_shot", "two_shot", "nccl")])
    return table


def eager_lines(rows: list[dict]) -> list[str]:
    """Ours and NCCL called one at a time from Python (no CUDA graph)."""
    got = {(r["impl"], r["bytes"]): r["time_s"] for r in rows if r["impl"].endswith(" eager")}
    return [f"eager (no graph), {human(b)}: ours {got[('ours eager', b)] * 1e6:.1f} us, "
            f"NCCL {got[('NCCL eager', b)] * 1e6:.1f} us"
            for b in sorted({b for _, b in got})
            if ("ours eager", b) in got and ("NCCL eager", b) in got]


def crossover_lines(summary: dict) -> list[str]:
    def b(x) -> str:
        return "none" if not x else human(int(x))

    beta = summary["beta_s_per_byte"]
    link = 1 / beta / 1e9 if beta else math.inf
    return [
        f"alpha-beta fitted on our one-shot: alpha (one barrier) = "
        f"{summary['alpha_s'] * 1e6:.2f} us, 1/beta = {link:.0f} GB/s per peer link; "
        f"NCCL's ring: alpha = {summary['nccl_alpha_s'] * 1e6:.2f} us",
        f"two-shot beats one-shot from: predicted {b(summary['two_over_one_predicted_bytes'])}, "
        f"measured {b(summary['two_over_one_measured_bytes'])}",
        f"NCCL beats ours from: predicted {b(summary['nccl_over_ours_predicted_bytes'])}, "
        f"measured {b(summary['nccl_over_ours_measured_bytes'])}",
    ]


def plot_peer_busbw(rows: list[dict], path: str | Path, title: str) -> Path:
    """busbw (GB/s) vs size, one line per contender."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for impl in ORDER + GATHER_SCATTER:
        pts = sorted((r["bytes"], r["busbw"] / 1e9) for r in rows
                     if r["impl"] == impl and r["busbw"] == r["busbw"])
        if pts:
            style = ("o-" if impl.startswith("ours") else "s--") if impl in ORDER else \
                ("^-" if impl.startswith("ours") else "v:")
            ax.plot(*zip(*pts, strict=True), style, markersize=3, label=impl)
    ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="busbw (GB/s)",
           title=title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def markdown(rows: list[dict], summary: dict) -> str:
    """The latency/bandwidth table and the choice table as markdown (for BENCHMARKS.md)."""
    impls = [i for i in ORDER if any(r["impl"] == i for r in rows)]
    lines = ["| size | " + " | ".join(f"{i} (us)" for i in impls)
             + " | NCCL / ours | busbw ours (GB/s) |",
             "| --- |" + " --- |" * (len(impls) + 2)]
    for size, per in _by_size([r for r in rows if r["impl"] in ORDER]).items():
        ours = per.get("ours (by size)", {}).get("time_s", math.nan)
        nccl = per.get("NCCL", {}).get("time_s", math.nan)
        cells = [_us(per.get(i, {}).get("time_s", math.nan)) for i in impls]
        busbw = per.get("ours (by size)", {}).get("busbw", math.nan)
        lines.append(f"| {human(size)} | " + " | ".join(cells)
                     + f" | {nccl / ours:.2f}x | {busbw / 1e9:.1f} |")
    lines += ["", "| collective | size | ours (us) | NCCL (us) | ours / NCCL busbw |",
              "| --- | --- | --- | --- | --- |"]
    for kind in ("all_gather", "reduce_scatter"):
        ours = {r["bytes"]: r for r in rows if r["impl"] == f"ours {kind}"}
        nccl = {r["bytes"]: r for r in rows if r["impl"] == f"NCCL {kind}"}
        lines += [f"| {kind} | {human(s)} | {_us(ours[s]['time_s'])} | "
                  f"{_us(nccl[s]['time_s'])} | {ours[s]['busbw'] / nccl[s]['busbw']:.2f}x |"
                  for s in sorted(set(ours) & set(nccl))]
    lines += ["", "| size | chosen | fastest measured |", "| --- | --- | --- |"]
    lines += [f"| {human(r['bytes'])} | {r['chosen']} | {r['fastest']} |"
              for r in summary["choice"]]
    lines += [""] + [f"- {line}" for line in crossover_lines(summary) + eager_lines(rows)]
    knobs = knob_lines(rows)
    if knobs:
        lines += ["", "Knobs, one at a time (the rest at their defaults):", ""] + knobs
    return "\n".join(lines) + "\n"
