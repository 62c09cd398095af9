"""fp8 e4m3 matmul with per-tensor scales: layer 1's grouped matmul kernel (matmul.py) run
with fp8 operands and an fp32 accumulator, the scales applied in its epilogue.

Shapes: a_fp8 (M, K), b_fp8 (K, N) -> (M, N) in out_dtype. Needs compute capability >= 8.9
on the GPU; on a CPU (or impl="torch") the fp32 reference runs.
"""
from __future__ import annotations

import torch

from . import interpreter
from .matmul import _DTYPES, _FP8, _check_operands, _launch, _matmul_fp8_tuned


def _check_scale(s: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    if not isinstance(s, torch.Tensor) or s.numel() != 1:
        raise ValueError(f"{name} must be a one-element tensor (per-tensor scale)")
    if s.device != device:
        raise ValueError(f"{name} is on {s.device}, the operands on {device}")
    return s.reshape(1).to(torch.float32)


def matmul_fp8_reference(
    a_fp8: torch.Tensor,
    b_fp8: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """torch reference: (a * scale_a) @ (b * scale_b) in fp32, cast to out_dtype."""
    prod = a_fp8.to(torch.float32) @ b_fp8.to(torch.float32)
    return (prod * (scale_a.float() * scale_b.float()).reshape(())).to(out_dtype)


def matmul_fp8(a_fp8: torch.Tensor, b_fp8: torch.Tensor, scale_a: torch.Tensor,
               scale_b: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
               *, impl: str = "auto") -> torch.Tensor:
    """C = (A*scale_a) @ (B*scale_b) with fp8 e4m3 operands, fp32 accumulate, per-tensor scales.

    a_fp8 (M, K), b_fp8 (K, N) torch.float8_e4m3fn; scale_a, scale_b one-element fp32 tensors
    (the dequantization factors: real value = fp8 value * scale). Returns (M, N) out_dtype.
    Needs compute capability >= 8.9 (Ada/Hopper fp8 tensor cores) on the GPU. Pass b
    column-major (b = w.T for a contiguous (N, K) w), as torch._scaled_mm wants; a row-major
    b is first copied into that layout.
    Bytes: (M*K + K*N) * 1 + M*N * out_itemsize; FLOPs 2*M*N*K at the fp8 rate (2x bf16).
    """
    if _FP8 is None:
        raise ValueError("this torch has no torch.float8_e4m3fn")
    _check_operands(a_fp8, b_fp8, (_FP8,))
    if out_dtype not in _DTYPES:
        raise ValueError(f"unsupported out_dtype {out_dtype}: expected one of {_DTYPES}")
    sa = _check_scale(scale_a, "scale_a", a_fp8.device)
    sb = _check_scale(scale_b, "scale_b", a_fp8.device)
    if not interpreter.use_triton(impl, a_fp8, "matmul_fp8"):
        return matmul_fp8_reference(a_fp8, b_fp8, sa, sb, out_dtype)
    if a_fp8.is_cuda and torch.cuda.get_device_capability(a_fp8.device) < (8, 9):
        raise ValueError("fp8 matmul needs compute capability >= 8.9 (Ada or Hopper)")
    if b_fp8.shape[1] > 1 and b_fp8.stride(0) != 1:
        # Hopper's fp8 tensor-core instructions read B K-major only; a row-major B forces a
        # slow shuffle (measured 290 vs 1242 TFLOP/s at 8192^3 on an H100). One copy of B
        # into column-major (K*N bytes) costs far less than that.
        b_fp8 = b_fp8.T.contiguous().T
    c = torch.empty((a_fp8.shape[0], b_fp8.shape[1]), device=a_fp8.device, dtype=out_dtype)
    return _launch(_matmul_fp8_tuned, a_fp8, b_fp8, c, sa, sb)
