"""The sweep, presented: time vs size (measured and predicted), busbw vs size, and the
ours-vs-built-in table (for the terminal and for BENCHMARKS.md).

Both axes are logarithmic because sizes span eight orders of magnitude: on the time
plot, the flat left part is latency (alpha) and the slope-1 right part is bandwidth
(beta), and the alpha-beta prediction is a line that bends between the two. The busbw
plot climbs from near zero (small messages are all latency) to a plateau — the link's
usable bandwidth, comparable across world sizes because of the busbw factor.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402


def _series(rows: Iterable[dict], y: str) -> dict[str, tuple[list[float], list[float]]]:
    """Group rows by their label ("algorithm" or "label") into sorted (bytes, y) series."""
    groups: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        groups[row.get("label") or row["algorithm"]].append((row["bytes"], row[y]))
    return {k: tuple(map(list, zip(*sorted(v), strict=True))) for k, v in groups.items()}


def plot_predicted_vs_measured(measured: list[dict], predicted: list[dict], path: str | Path,
                               title: str = "time vs message size") -> Path:
    """Measured rows (solid, markers) and predicted rows (dashed) as time (s) vs bytes."""
    fig, ax = plt.subplots(figsize=(8, 5))
    colors: dict[str, str] = {}
    for label, (x, y) in _series(measured, "time_s").items():
        (line,) = ax.plot(x, y, "o-", markersize=3, label=f"{label} (measured)")
        colors[label] = line.get_color()
    for label, (x, y) in _series(predicted, "time_s").items():
        ax.plot(x, y, "--", color=colors.get(label), label=f"{label} (alpha-beta)")
    ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="time (s)",
           title=title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_busbw(rows: list[dict], path: str | Path,
               title: str = "bus bandwidth vs message size") -> Path:
    """busbw (GB/s) vs bytes, one line per algorithm (ours solid, built-in dashed)."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, (x, y) in _series(rows, "busbw").items():  # by algorithm: ours vs torch.<name>
        style = "s--" if label.startswith("torch.") else "o-"
        ax.plot(x, [v / 1e9 for v in y], style, markersize=3, label=label)
    ax.set(xscale="log", xlabel="message size (bytes)", ylabel="busbw (GB/s)", title=title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def pairs(rows: list[dict]):
    """(collective, bytes, ours row, built-in row) for the side-by-side tables."""
    torch_rows = {(r["collective"], r["bytes"]): r for r in rows if r["impl"] == "torch"}
    for r in rows:
        if (
            r["impl"] == "ours"
            and (r["collective"], r["bytes"]) in torch_rows
            and r["algorithm"] != "tree_all_reduce"
        ):
            yield r["collective"], r["bytes"], r, torch_rows[r["collective"], r["bytes"]]


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}" if seconds >= 1e-4 else f"{seconds * 1e6:.1f}"


def gbs(bytes_per_s: float) -> str:
    v = bytes_per_s / 1e9
    return f"{v:.1f}" if v >= 10 else f"{v:.3f}"


def human(nbytes: float) -> str:
    """8 B, 1.99 KiB, 256 MiB, 1 GiB."""
    value, unit = float(nbytes), "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.0f} {unit}" if value == int(value) else f"{value:.3g} {unit}"


SIDE_BY_SIDE = ("collective", "size", "ours us", "torch us", "ours busbw GB/s",
                "torch busbw GB/s", "ratio")


def side_by_side(rows: list[dict]) -> list[tuple[str, ...]]:
    """The cells of the ours-vs-built-in table (printed, and written to bench.md)."""
    return [
        (
            kind,
            human(b),
            us(o["time_s"]),
            us(t["time_s"]),
            gbs(o["busbw"]),
            gbs(t["busbw"]),
            f"{o['busbw'] / t['busbw']:.2f}" if t["busbw"] else "-",
        )
        for kind, b, o, t in pairs(rows)
    ]


def markdown(rows: list[dict], record: dict) -> str:
    head = (f"{record['world']} ranks, {record['backend']}, {record['device']}, torch "
            f"{record['torch']}, "
            f"NCCL {record['nccl']}, {record['date']}\n\n")
    lines = [
        "| " + " | ".join(SIDE_BY_SIDE) + " |",
        "|---" + "|---:" * (len(SIDE_BY_SIDE) - 1) + "|",
    ]
    lines += ["| " + " | ".join(cells) + " |" for cells in side_by_side(rows)]
    return head + "\n".join(lines) + "\n"
