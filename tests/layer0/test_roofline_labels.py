"""Roofline labels can be read: crowded points get numbers that overlap neither each other
nor any point, and the PNG names every point in its key."""
from __future__ import annotations

import itertools
import random

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

from layer0_hardware import Ceilings, RooflinePoint, plot_roofline
from layer0_hardware.plot_labels import place_labels


def _crowd(n: int, seed: int) -> tuple[list[float], list[float]]:
    """Points bunched on a bandwidth slope, like an H100's elementwise kernels."""
    rng = random.Random(seed)
    xs = [10 ** rng.uniform(-0.4, 0.35) for _ in range(n)]
    return xs, [x * 3e12 * rng.uniform(0.75, 0.98) for x in xs]


def test_crowded_labels_overlap_nothing():
    xs, ys = _crowd(18, seed=3)
    fig = Figure(figsize=(8, 6), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.1, 0.1, 0.85, 0.85))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1e-2, 1e4)
    ax.set_ylim(1e10, 1e16)
    ax.scatter(xs, ys, s=16)
    fig.canvas.draw()
    place_labels(ax, xs, ys, [str(i) for i in range(1, 19)])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    # The text's own box (an Annotation's extent would include its leader line).
    boxes = [Text.get_window_extent(t, renderer) for t in ax.texts]
    assert len(boxes) == 18
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b), "two labels overlap"
    markers = ax.transData.transform(list(zip(xs, ys, strict=True)))
    for box in boxes:
        assert not any(box.x0 < x < box.x1 and box.y0 < y < box.y1 for x, y in markers)
        frame = ax.get_window_extent()
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1


def test_png_with_many_points(tmp_path):
    xs, ys = _crowd(20, seed=5)
    name = "kernel {} with a long descriptive name 16384x8192 bf16"
    points = [RooflinePoint(name.format(i), x * 1e9, 1e9, 1e9 * x / y)
              for i, (x, y) in enumerate(zip(xs, ys, strict=True))]
    ceilings = Ceilings("H100 test", "cuda", 3e12, {"bf16": 7.9e14, "fp32": 5e13}, 4e-6)
    path = plot_roofline(ceilings, points, tmp_path / "roofline.png")
    assert path.read_bytes().startswith(b"\x89PNG")
