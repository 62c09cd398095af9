"""Timeline pictures of a pipelined step: one lane per rank, one box per forward/backward.

Forward boxes are blue, backward boxes orange, each labelled with its micro-batch; the
white gaps are the bubble. Times are shown in ms from the step's first start.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

COLORS = {"F": "#4C72B0", "B": "#DD8452"}


def plot_timeline(lanes: Sequence[Sequence[tuple[str, int, float, float]]], path: str | Path,
                  title: str, lane_names: Sequence[str] | None = None) -> Path:
    """Draw lanes[r] = [(kind, micro, start_s, end_s)] as one row per rank; writes a PNG.

    Returns the path. Times may be absolute (perf_counter): they are shifted to start at 0.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    if not lanes or not any(lanes):
        raise ValueError("plot_timeline needs at least one lane with events")
    t0 = min(e[2] for lane in lanes for e in lane)
    t1 = max(e[3] for lane in lanes for e in lane)
    names = list(lane_names) if lane_names else [f"rank {r}" for r in range(len(lanes))]
    fig, ax = plt.subplots(figsize=(11, 0.8 * len(lanes) + 1.6))
    for row, lane in enumerate(lanes):
        y = len(lanes) - 1 - row  # rank 0 on top
        for kind, micro, start, end in lane:
            x, w = (start - t0) * 1e3, (end - start) * 1e3
            ax.broken_barh([(x, w)], (y - 0.38, 0.76), facecolors=COLORS[kind],
                           edgecolor="black", linewidth=0.6)
            if w > (t1 - t0) * 1e3 / 60:  # label only boxes wide enough to hold it
                ax.text(x + w / 2, y, f"{kind}{micro}", ha="center", va="center",
                        color="white", fontsize=10, fontweight="bold")
    ax.set_yticks(range(len(lanes)), names[::-1], fontsize=11)
    ax.set_xlabel("time (ms)", fontsize=11)
    ax.set_xlim(0, (t1 - t0) * 1e3)
    ax.set_title(title, fontsize=12)
    ax.grid(axis="x", alpha=0.3)
    used = [k for k in COLORS if any(e[0] == k for lane in lanes for e in lane)]  # inference: F
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in used]
    labels = [{"F": "forward", "B": "backward"}.get(k, k) for k in used]
    ax.legend(handles, labels, loc="upper left", fontsize=9,
              bbox_to_anchor=(1.005, 1.0), frameon=False)  # outside, clear of the title
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_rank_timelines(lanes: Sequence[Sequence[tuple[str, int, float, float]]],
                        directory: str | Path, stem: str, title: str) -> list[Path]:
    """One PNG per rank (`{stem}_rank{r}.png`) on a shared time axis, plus `{stem}.png`
    with every rank stacked; returns the paths, the combined one first."""
    directory = Path(directory)
    paths = [plot_timeline(lanes, directory / f"{stem}.png", title)]
    t0 = min(e[2] for lane in lanes for e in lane)
    for r, lane in enumerate(lanes):
        anchored = [("F", -1, t0, t0)] if lane and lane[0][2] > t0 else []  # keep the axis
        paths.append(plot_timeline([anchored + list(lane)], directory / f"{stem}_rank{r}.png",
                                   f"{title} — rank {r}", [f"rank {r}"]))
    return paths
