"""FP8 matmul through ``torch._scaled_mm``, defensively across torch 2.4 .. 2.13.

FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell) take e4m3 operands
plus per-tensor float32 scales and accumulate in higher precision. ``torch._scaled_mm``
is a private API whose signature moved: torch 2.1-2.3 made scales optional keywords and
returned ``(out, amax)``; 2.4+ takes ``scale_a, scale_b`` as required arguments and
returns one tensor. cuBLASLt wants A row-major and B column-major, both dims multiples of 16.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def fp8_supported(device: torch.device) -> bool:
    """True when this torch has float8_e4m3fn and ``device`` has FP8 tensor cores."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _call_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # use_fast_accum skips the periodic promotion of partial sums to full fp32 on Hopper;
    # it is how FP8 inference GEMMs run and what the datasheet rate assumes.
    try:
        out = torch._scaled_mm(a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16,
                               use_fast_accum=True)
    except TypeError:  # an older signature without those keywords: try positional scales
        out = torch._scaled_mm(a, b, scale, scale, out_dtype=torch.bfloat16)
    return out[0] if isinstance(out, tuple) else out  # torch < 2.4 also returned amax


def fp8_matmul_fn(n: int, device: torch.device) -> Callable[[], torch.Tensor]:
    """A closure that multiplies two random n x n e4m3 matrices into bf16.

    Raises NotImplementedError when the device, torch build or API cannot do it.
    """
    if not fp8_supported(device):
        raise NotImplementedError(
            f"fp8 matmul needs torch.float8_e4m3fn, torch._scaled_mm and a GPU of compute "
            f"capability >= 8.9 (device: {device}, torch {torch.__version__})")
    if n % 16:
        raise ValueError(f"fp8 matmul needs n to be a multiple of 16, got {n}")
    # randn values (|x| < ~5) sit comfortably inside e4m3's range of +-448, so scale 1 is fine.
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    # B column-major: build it row-major as (n, k) and view it transposed.
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
    scale = torch.ones((), device=device, dtype=torch.float32)
    try:
        _call_scaled_mm(a, b, scale)  # one trial call: surface API errors here, clearly
    except (RuntimeError, TypeError) as err:
        raise NotImplementedError(f"torch._scaled_mm failed on {device}: {err}") from err
    return lambda: _call_scaled_mm(a, b, scale)
