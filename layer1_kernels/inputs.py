"""Input checks the kernels' host wrappers share: a bad tensor becomes a ValueError naming
the argument and what was wrong, before any launch (a kernel given a wrong dtype or a tensor
on another device would read garbage or crash the process instead)."""
from __future__ import annotations

import torch


def check_operand_pair(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor,
                       dtypes: tuple) -> None:
    """Two operands of one op: the same dtype, one of `dtypes`, on the same device."""
    if a.dtype != b.dtype:
        raise ValueError(f"{a_name} and {b_name} dtypes differ: {a.dtype} vs {b.dtype} "
                         "(they must have the same dtype)")
    if a.dtype not in dtypes:
        raise ValueError(f"unsupported dtype {a.dtype}: expected one of {dtypes}")
    if a.device != b.device:
        raise ValueError(f"{a_name} and {b_name} are on different devices: {a.device} vs "
                         f"{b.device}")


def check_like(what: str, t: torch.Tensor, x: torch.Tensor) -> None:
    """A tensor that stands in for x (an output buffer, a residual): x's shape, dtype and
    device."""
    if t.shape != x.shape or t.dtype != x.dtype or t.device != x.device:
        raise ValueError(f"{what} must match x: shape {tuple(x.shape)}, {x.dtype} on {x.device}; "
                         f"got shape {tuple(t.shape)}, {t.dtype} on {t.device}")
