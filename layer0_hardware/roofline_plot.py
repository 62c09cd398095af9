"""Draw the roofline: a log-log plot of FLOP/s against arithmetic intensity.

Uses matplotlib's object API with the Agg canvas directly (no pyplot), so it works
headless and never changes the global backend of a notebook that imports us.

Readable with many points: each point is numbered on the plot (numbers placed clear of one
another by plot_labels.py) and named in a key beside it, with what it achieved; the roofs'
legend sits beside the plot too, so nothing covers a point.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from .ceilings import Ceilings
from .datasheet import AcceleratorSpec
from .plot_labels import place_labels
from .roofline import RooflinePoint, ridge_point
from .units import fmt_bandwidth, fmt_flops

_COLORS = {"fp32": "tab:blue", "tf32": "tab:cyan", "fp16": "tab:orange", "bf16": "tab:red",
           "fp8": "tab:purple", "int8": "tab:brown"}
_KEY_CHARS = 64  # a key line wraps after this many characters
_KEY_FONT = 7.5
NBSP = "\u00a0"


def _x_range(ceilings: Ceilings, points: list[RooflinePoint],
             datasheet: AcceleratorSpec | None) -> tuple[float, float]:
    # Span every point and every ridge, with a decade of margin on each side.
    xs = [p.intensity for p in points if p.intensity > 0]
    xs += [ridge_point(f, ceilings.memory_bandwidth) for f in ceilings.flops.values()]
    if datasheet is not None:
        xs += [ridge_point(f, datasheet.memory_bandwidth) for f in datasheet.peak_flops.values()]
    xs = xs or [1.0]
    return min(xs) / 10, max(xs) * 10


def _draw_roofs(ax, ceilings: Ceilings, datasheet: AcceleratorSpec | None,
                x: np.ndarray) -> list[Line2D]:
    """Solid measured roof per dtype, dashed datasheet roof; one legend handle per dtype."""
    handles = []
    for dtype, peak in sorted(ceilings.flops.items(), key=lambda kv: kv[1]):
        color = _COLORS.get(dtype, "black")
        ridge = ridge_point(peak, ceilings.memory_bandwidth)
        ax.plot(x, np.minimum(peak, x * ceilings.memory_bandwidth), color=color, lw=2)
        if datasheet is not None and dtype in datasheet.peak_flops:
            ds_peak = datasheet.peak_flops[dtype]
            ax.plot(x, np.minimum(ds_peak, x * datasheet.memory_bandwidth), color=color,
                    lw=1, ls="--", alpha=0.8)
        handles.append(Line2D([], [], color=color, lw=2,
                              label=f"{dtype}: {fmt_flops(peak)}, ridge {ridge:.3g} FLOP/B"))
    if datasheet is not None:
        handles.append(Line2D([], [], color="0.3", lw=1, ls="--",
                              label=f"dashed: {datasheet.name} datasheet"))
    return handles


def _key_lines(points: list[RooflinePoint]) -> list[str]:
    """'n  name: achieved' per point, long ones wrapped under their number."""
    lines = []
    for i, p in enumerate(points, start=1):
        # No-break spaces inside "3.04 TB/s": a wrap never parts a number from its unit.
        rates = f"{fmt_flops(p.achieved_flops)}, {fmt_bandwidth(p.achieved_bandwidth)}"
        text = f"{p.name}: {rates.replace(' ', NBSP).replace(',' + NBSP, ', ')}"
        wrapped = textwrap.wrap(text, _KEY_CHARS) or [""]
        lines.append(f"{i:>2}  {wrapped[0]}")
        lines += [f"    {more}" for more in wrapped[1:]]
    return lines


def plot_roofline(ceilings: Ceilings, points: list[RooflinePoint], path: str | Path, *,
                  datasheet: AcceleratorSpec | None = None, title: str | None = None) -> Path:
    """Write a PNG roofline to ``path`` and return it.

    Solid lines: the measured roof, min(peak_dtype, intensity * measured bandwidth), one
    per measured dtype. Dashed: the datasheet roof for the same dtypes, if given.
    Dots: the measured ``points`` at (intensity, achieved FLOP/s), numbered; the key
    beside the plot names each number.
    """
    if ceilings.memory_bandwidth <= 0 or not ceilings.flops:
        raise ValueError("ceilings need a positive memory_bandwidth and at least one dtype")
    lo, hi = _x_range(ceilings, points, datasheet)
    x = np.logspace(np.log10(lo), np.log10(hi), 400)
    key = _key_lines(points)
    # Tall enough for the legend and every key line at _KEY_FONT points.
    height = max(6.5, 2.2 + (len(key) + len(ceilings.flops) + 2) * _KEY_FONT * 1.45 / 72)

    fig = Figure(figsize=(14, height), dpi=110)
    FigureCanvasAgg(fig)  # attaches the Agg canvas that savefig renders with
    # Fixed positions (no tight_layout after the labels are placed: they are in pixels).
    ax = fig.add_axes((0.065, 0.09, 0.5, 0.83))
    side = fig.add_axes((0.6, 0.02, 0.39, 0.9))
    side.axis("off")
    ax.set_xscale("log")
    ax.set_yscale("log")
    handles = _draw_roofs(ax, ceilings, datasheet, x)
    ax.set_xlim(lo, hi)

    xs = [p.intensity for p in points]
    ys = [p.achieved_flops for p in points]
    if points:
        ax.scatter(xs, ys, s=16, color="black", zorder=5)
        tops = ys + [max(ceilings.flops.values())]
        ax.set_ylim(min(ys + [lo * ceilings.memory_bandwidth]) / 3, max(tops) * 3)

    bw_text = f"{fmt_bandwidth(ceilings.memory_bandwidth)} measured"
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title or f"Roofline: {ceilings.device_name} ({bw_text})")
    ax.grid(True, which="both", alpha=0.3)

    legend = side.legend(handles=handles, loc="upper left", fontsize=8, frameon=False,
                         title=f"measured roofs ({bw_text})", title_fontsize=8,
                         alignment="left")
    fig.canvas.draw()  # the legend's height, and the axes' final pixels for the labels
    top = side.transAxes.inverted().transform(legend.get_window_extent())[0][1] - 0.02
    side.text(0.0, top, "\n".join(key), transform=side.transAxes, va="top", ha="left",
              family="monospace", fontsize=_KEY_FONT, linespacing=1.35)
    place_labels(ax, xs, ys, [str(i) for i in range(1, len(points) + 1)], fontsize=8)

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, format="png")
    return target
