"""Where layers write what they measured (JSON, PNG)."""
from __future__ import annotations

import os
from pathlib import Path


def results_dir(layer: int) -> Path:
    """``$LLM_STACK_RESULTS/layerN``, default ``./results/layerN``; created if missing."""
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
        raise ValueError(f"layer must be a non-negative int, got {layer!r}")
    root = os.environ.get("LLM_STACK_RESULTS")
    path = (Path(root) if root else Path("results")) / f"layer{layer}"
    path.mkdir(parents=True, exist_ok=True)
    return path
