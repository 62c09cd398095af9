"""Draw the roofline: a log-log plot of FLOP/s against arithmetic intensity.

Uses matplotlib's object API with the Agg canvas directly (no pyplot), so it works
headless and never changes the global backend of a notebook that imports us.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .ceilings import Ceilings
from .datasheet import AcceleratorSpec
from .roofline import RooflinePoint, ridge_point

_COLORS = {"fp32": "tab:blue", "tf32": "tab:cyan", "fp16": "tab:orange", "bf16": "tab:red",
           "fp8": "tab:purple", "int8": "tab:brown"}


def _x_range(ceilings: Ceilings, points: list[RooflinePoint],
             datasheet: AcceleratorSpec | None) -> tuple[float, float]:
    # Span every point and every ridge, with a decade of margin on each side.
    xs = [p.intensity for p in points if p.intensity > 0]
    xs += [ridge_point(f, ceilings.memory_bandwidth) for f in ceilings.flops.values()]
    if datasheet is not None:
        xs += [ridge_point(f, datasheet.memory_bandwidth) for f in datasheet.peak_flops.values()]
    xs = xs or [1.0]
    return min(xs) / 10, max(xs) * 10


def plot_roofline(ceilings: Ceilings, points: list[RooflinePoint], path: str | Path, *,
                  datasheet: AcceleratorSpec | None = None, title: str | None = None) -> Path:
    """Write a PNG roofline to ``path`` and return it.

    Solid lines: the measured roof, min(peak_dtype, intensity * measured bandwidth), one
    per measured dtype. Dashed: the datasheet roof for the same dtypes, if given.
    Dots: the measured ``points`` at (intensity, achieved FLOP/s), labelled by name.
    """
    if ceilings.memory_bandwidth <= 0 or not ceilings.flops:
        raise ValueError("ceilings need a positive memory_bandwidth and at least one dtype")
    lo, hi = _x_range(ceilings, points, datasheet)
    x = np.logspace(np.log10(lo), np.log10(hi), 400)

    fig = Figure(figsize=(9, 6), dpi=110)
    FigureCanvasAgg(fig)  # attaches the Agg canvas that savefig renders with
    ax = fig.add_subplot(1, 1, 1)
    ax.set_xscale("log")
    ax.set_yscale("log")

    for dtype, peak in sorted(ceilings.flops.items(), key=lambda kv: kv[1]):
        color = _COLORS.get(dtype, "black")
        ridge = ridge_point(peak, ceilings.memory_bandwidth)
        ax.plot(x, np.minimum(peak, x * ceilings.memory_bandwidth), color=color, lw=2,
                label=f"measured {dtype}: {peak / 1e12:.3g} TFLOP/s, ridge {ridge:.3g} FLOP/B")
        if datasheet is not None and dtype in datasheet.peak_flops:
            ds_peak = datasheet.peak_flops[dtype]
            ax.plot(x, np.minimum(ds_peak, x * datasheet.memory_bandwidth), color=color,
                    lw=1, ls="--", alpha=0.8, label=f"{datasheet.name} datasheet {dtype}")

    for point in points:
        ax.scatter([point.intensity], [point.achieved_flops], s=40, color="black", zorder=5)
        ax.annotate(point.name, (point.intensity, point.achieved_flops), fontsize=8,
                    xytext=(5, 5), textcoords="offset points")

    bw_text = f"{ceilings.memory_bandwidth / 1e9:.4g} GB/s measured"
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title or f"Roofline: {ceilings.device_name} ({bw_text})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, format="png")
    return target
