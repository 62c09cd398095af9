"""The bitmask applied on the device in one launch: a Triton kernel, beside its torch reference.

    logits (N, V) float, any row stride     bitmask (R, W) int32, W = ceil(V / 32)
    rows (R,) int: bitmask row r masks logits row rows[r]; the other N - R rows are not read

Program (r, b) reads the BLOCK logits positions t of block b of row rows[r]: the word
t // 32 of bitmask row r (BLOCK / 32 distinct words, each loaded once into L1 and reused by
its 32 lanes) and bit t % 32 of it. Where the bit is 0 it stores -inf; allowed positions
are neither read nor written. So one launch does the unpack, the mask and the row
selection that the torch reference (`unpack` + `masked_fill_` on an index gather/scatter)
spreads over about seven kernels and two (R, V) temporaries: at R = 32, V = 4,096 that is
one ~5 us launch instead of seven, and at V = 128k it writes only the refused logits
(4 bytes each) and reads 16 KB of bitmask.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# importing layer 3 (which layer 4 always does first) has set TRITON_INTERPRET on a machine
# without CUDA, before this kernel is defined: there it runs in Triton's interpreter
import layer3_model  # noqa: F401

BLOCK = 2048


@triton.jit
def _apply_bitmask_kernel(logits_ptr, logits_stride, bitmask_ptr, rows_ptr, V, W,
                          BLOCK: tl.constexpr):
    r = tl.program_id(0)
    b = tl.program_id(1)
    row = tl.load(rows_ptr + r).to(tl.int64)
    t = b * BLOCK + tl.arange(0, BLOCK)
    inside = t < V
    word = tl.load(bitmask_ptr + r * W + t // 32, mask=inside, other=-1)
    refused = ((word >> (t % 32)) & 1) == 0
    ninf = tl.full((BLOCK,), float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * logits_stride + t, ninf, mask=inside & refused)


def apply_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor,
                         rows: torch.Tensor) -> torch.Tensor:
    """logits (N, V) (last dim contiguous), bitmask (R, W) int32 contiguous, rows (R,) int32
    or int64, all on one device: refused tokens of logits[rows[r]] -> -inf in place."""
    R, W = bitmask.shape
    V = logits.shape[1]
    if R == 0:
        return logits
    if logits.stride(1) != 1 or not bitmask.is_contiguous() or not rows.is_contiguous():
        raise ValueError("the bitmask kernel needs contiguous rows of logits, a contiguous "
                         "bitmask and contiguous row indices")
    grid = (R, triton.cdiv(V, BLOCK))
    _apply_bitmask_kernel[grid](logits, logits.stride(0), bitmask, rows, V, W, BLOCK=BLOCK,
                                num_warps=4)
    return logits
