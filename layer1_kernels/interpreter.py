"""Run Triton kernels on the CPU when there is no GPU.

Triton picks between compiling a kernel and interpreting it (with numpy) when the
kernel is *defined* (`@triton.jit`), by reading TRITON_INTERPRET. So this module must be
imported before any kernel module: `layer1_kernels/__init__.py` imports it first.
"""
from __future__ import annotations

import os

import torch

#: True when kernels run through Triton's interpreter (no CUDA device visible).
INTERPRETED: bool = not torch.cuda.is_available()

if INTERPRETED:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    INTERPRETED = os.environ["TRITON_INTERPRET"] == "1"


def kernel_device() -> torch.device:
    """The device Triton kernels run on here: CUDA if present, else the CPU (interpreted)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
