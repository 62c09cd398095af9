"""Where the shipped course models live: models/course-target and models/course-draft.

They are committed beside the packages (an editable install or a checkout finds them);
$LLM_STACK_MODELS points elsewhere (a copy, or models you trained yourself with
`python -m layer3_model.training.train`).
"""
from __future__ import annotations

import os
from pathlib import Path

COURSE_MODEL_SIZES = ("target", "draft")


def course_model_dir(size: str = "target") -> Path:
    """The HF directory of the course target (~11M parameters) or draft (~1.2M) model."""
    if size not in COURSE_MODEL_SIZES:
        raise ValueError(f"unknown course model {size!r}: expected one of "
                         f"{', '.join(COURSE_MODEL_SIZES)}")
    root = Path(
        os.environ.get("LLM_STACK_MODELS") or Path(__file__).resolve().parents[1] / "models"
    )
    path = root / f"course-{size}"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"course model {size!r} not found at {path} (no config.json). It "
            "ships in the repository's "
            "models/ folder; set LLM_STACK_MODELS to the folder holding "
            f"course-{size}/, or train one with "
            f"`python -m layer3_model.training.train --size {size} --out DIR/course-{size}`")
    return path
