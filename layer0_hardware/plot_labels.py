"""Place short labels next to crowded points so that none covers another label or point.

A roofline of twenty kernels has a dozen of them within a factor of three of each other on
the bandwidth slope: labels written at a fixed offset pile up into an unreadable smear.
Here each label tries positions around its point, nearest first, and takes the first
whose box is clear of every label placed so far, every point, and the axes' edges; a label
pushed away from its point gets a thin leader line back to it. Greedy, and fine for the
tens of points a plot shows (a package such as adjustText does more, at the cost of a
dependency the GPU machine would have to carry).
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.axes import Axes

Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in display pixels

_RADII_PX = (7, 16, 26, 38, 52, 68, 86)
# Right of the point first (where a reader looks), then the diagonals, then the rest.
_ANGLES = tuple(math.radians(a) for a in (0, 45, 315, 180, 135, 225, 90, 270,
                                          22, 338, 158, 202, 68, 292, 112, 248))
_MARKER_HALF_PX = 5.0


def _overlap(a: Box, b: Box) -> float:
    """Area two boxes share."""
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return w * h if w > 0 and h > 0 else 0.0


def _box_at(x: float, y: float, dx: float, dy: float, w: float, h: float) -> Box:
    """The text box of a label whose anchor is (dx, dy) px from its point, aligned away
    from the point (left-aligned to the right of it, right-aligned to its left, ...)."""
    cx, cy = x + dx, y + dy
    left = cx if dx > 1 else cx - w if dx < -1 else cx - w / 2
    bottom = cy if dy > 1 else cy - h if dy < -1 else cy - h / 2
    return left, bottom, left + w, bottom + h


def _alignment(dx: float, dy: float) -> tuple[str, str]:
    horizontal = "left" if dx > 1 else "right" if dx < -1 else "center"
    vertical = "bottom" if dy > 1 else "top" if dy < -1 else "center"
    return horizontal, vertical


def place_labels(ax: Axes, xs: list[float], ys: list[float], labels: list[str], *,
                 fontsize: float = 8.0, color: str = "black") -> None:
    """Annotate point i at (xs[i], ys[i]) (data coordinates) with labels[i], every label
    clear of the others and of the points. Call after the axes' limits and position are
    final: placement is computed in display pixels."""
    if not labels:
        return
    fig = ax.figure
    px_per_pt = fig.dpi / 72.0
    points = ax.transData.transform(np.column_stack([xs, ys]))
    frame = ax.get_window_extent()
    obstacles = [(x - _MARKER_HALF_PX, y - _MARKER_HALF_PX, x + _MARKER_HALF_PX,
                  y + _MARKER_HALF_PX) for x, y in points]
    placed: list[Box] = []
    # Crowded points first: they have the fewest free spots, so they choose while many remain.
    crowding = [sum(math.dist(p, q) < 60 for q in points) for p in points]
    for i in sorted(range(len(labels)), key=lambda i: -crowding[i]):
        x, y = points[i]
        w = len(labels[i]) * fontsize * 0.62 * px_per_pt + 2
        h = fontsize * 1.15 * px_per_pt
        best, best_cost = None, math.inf
        for r in _RADII_PX:
            for angle in _ANGLES:
                dx, dy = r * math.cos(angle), r * math.sin(angle)
                box = _box_at(x, y, dx, dy, w, h)
                outside = (box[0] < frame.x0 or box[2] > frame.x1
                           or box[1] < frame.y0 or box[3] > frame.y1)
                cost = sum(_overlap(box, o) for o in (*placed, *obstacles)) + outside * 1e6
                if cost < best_cost:
                    best, best_cost = (dx, dy, box), cost
                if cost == 0:
                    break
            if best_cost == 0:
                break
        dx, dy, box = best
        placed.append(box)
        ha, va = _alignment(dx, dy)
        far = math.hypot(dx, dy) > _RADII_PX[0] + 0.5  # not beside its point: a leader line
        ax.annotate(labels[i], (xs[i], ys[i]), xytext=(dx / px_per_pt, dy / px_per_pt),
                    textcoords="offset points", ha=ha, va=va, fontsize=fontsize, color=color,
                    zorder=6, arrowprops={"arrowstyle": "-", "lw": 0.7, "color": "0.3",
                                          "shrinkA": 1, "shrinkB": 2} if far else None)
