"""Reductions and elementwise maps with CuPy: three ways to write a CUDA kernel from Python.

1. `reduce_sum(x)` -- a hand-written CUDA C kernel (cuda/reduce_sum.cu) loaded with
   `cupy.RawModule`: grid-stride loop, warp shuffles, shared memory, and a second pass
   over the per-block partials. You control everything, including the launch.
2. `cupy_silu_mul(gate, up)` -- a `cupy.ElementwiseKernel`: you write the body for ONE
   element; CuPy writes the indexing, the loop and the launch. Fusing SiLU and the
   multiply reads gate and up once and writes out once (unfused torch: 5 passes).
3. `cupy_row_rms(x)` -- a `cupy.ReductionKernel`: you give a map (x*x), a reduce (a + b)
   and a post-map (sqrt(a / n)); CuPy writes the tree reduction. The result is the
   per-row root-mean-square that RMSNorm divides by.

All three take torch CUDA tensors and return torch tensors without copies (CuPy views the
same memory through `__cuda_array_interface__`), launching on torch's current stream.
Without CuPy or a GPU they raise RuntimeError("CuPy kernels need a CUDA GPU and the cupy
package: ..."); each has a torch reference that runs anywhere.

Costs (n elements, float32): reduce_sum reads 4n bytes and does n adds (memory-bound);
silu_mul reads 2 and writes 1 element per element, ~5 FLOPs each; row_rms reads each
element once, 2 FLOPs each.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from . import cupy_support as cs
from . import interpreter  # noqa: F401  (layer-1 convention; these kernels do not use Triton)

_THREADS = 256
_BLOCKS_PER_SM = 8  # enough resident warps to keep ~40 KB of loads in flight per SM


# ---------------------------------------------------------------- 1. RawModule: reduce_sum
@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def reduce_sum_reference(x: torch.Tensor) -> torch.Tensor:
    """torch.sum of a 1-D float32 tensor (0-d result)."""
    return torch.sum(x)


def reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of a 1-D float32 CUDA tensor, as a 0-d float32 tensor on the same device.

    Two launches of cuda/reduce_sum.cu: a grid of a few blocks per SM reduces x to one
    partial per block; one block reduces the partials. Deterministic (no atomics).
    FLOPs: n. Bytes: 4 n.
    """
    cs.check_tensor("x", x, (torch.float32,))
    if x.dim() != 1:
        raise ValueError(f"x must be 1-D, got shape {tuple(x.shape)}")
    cs.require_cupy()
    cs.check_on_cuda("x", x)
    x = x.contiguous()
    n = x.numel()
    out = torch.empty(1, dtype=torch.float32, device=x.device)
    if n == 0:
        return out.zero_().reshape(())
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    kernel = cs.get_kernel("reduce_sum.cu", "reduce_sum_f32", index)
    blocks = max(1, min(-(-n // (_THREADS * 4)), _sm_count(index) * _BLOCKS_PER_SM))
    with cs.torch_stream(x.device):
        if blocks == 1:
            kernel((1,), (_THREADS,), (cs.as_cupy(x), np.int64(n), cs.as_cupy(out)))
        else:
            partials = torch.empty(blocks, dtype=torch.float32, device=x.device)
            kernel((blocks,), (_THREADS,), (cs.as_cupy(x), np.int64(n), cs.as_cupy(partials)))
            kernel((1,), (_THREADS,), (cs.as_cupy(partials), np.int64(blocks), cs.as_cupy(out)))
    return out.reshape(())


# ------------------------------------------------------- 2. ElementwiseKernel: silu_mul
# The body runs once per element; T is bound to the arrays' dtype (float32 or float16).
# Arithmetic is in float32 either way: for float16 that avoids overflow in exp and keeps
# the product as accurate as the output format allows.
_SILU_MUL_BODY = """
const float g = (float)gate;
const float u = (float)up;
out = (T)(g / (1.0f + expf(-g)) * u);
"""


@functools.lru_cache(maxsize=1)
def _silu_mul_kernel() -> Any:
    cupy = cs.require_cupy()
    return cupy.ElementwiseKernel("T gate, T up", "T out", _SILU_MUL_BODY, "llm_stack_silu_mul")


def cupy_silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up computed in float32, returned in gate's dtype."""
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


def cupy_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up elementwise (the SwiGLU MLP's activation), via cupy.ElementwiseKernel.

    gate, up: same shape, float32 or float16, on the same CUDA device. Returns a new
    contiguous tensor of that shape and dtype. FLOPs: ~5 per element. Bytes: 3 x element
    size per element (two reads, one write).
    """
    dtypes = (torch.float32, torch.float16)
    cs.check_tensor("gate", gate, dtypes)
    cs.check_tensor("up", up, dtypes)
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape; got {tuple(gate.shape)} and "
                         f"{tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"gate and up must have the same dtype; got {gate.dtype} and {up.dtype}")
    cs.require_cupy()
    cs.check_on_cuda("gate", gate)
    cs.check_on_cuda("up", up)
    if gate.device != up.device:
        raise ValueError("gate and up must be on the same device; got "
                         f"{gate.device} and {up.device}")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    with cs.torch_stream(gate.device):
        _silu_mul_kernel()(cs.as_cupy(gate), cs.as_cupy(up), cs.as_cupy(out))
    return out


# ------------------------------------------------------- 3. ReductionKernel: row RMS
# map: each element to its square (in float32); reduce: add pairs; post-map: divide by
# n, the row length (a scalar argument, the same for every output), and take the square
# root. identity "0" is what the reduction starts from.
_ROW_RMS_ARGS = (
    "T x, float32 n", "float32 y",
    "(float)x * (float)x",
    "a + b",
    "y = sqrt(a / n)",
    "0",
    "llm_stack_row_rms",
)


@functools.lru_cache(maxsize=1)
def _row_rms_kernel() -> Any:
    cupy = cs.require_cupy()
    return cupy.ReductionKernel(*_ROW_RMS_ARGS, reduce_type="float")


def cupy_row_rms_reference(x: torch.Tensor) -> torch.Tensor:
    """sqrt(mean(x**2)) over the last dimension, in float32."""
    return x.float().pow(2).mean(dim=-1).sqrt()


def cupy_row_rms(x: torch.Tensor) -> torch.Tensor:
    """Root-mean-square of each row (last dimension) of x, via cupy.ReductionKernel.

    x: (..., n) float32 or float16 CUDA tensor with n >= 1. Returns (...) float32.
    FLOPs: 2 per element. Bytes: one read per element.
    """
    cs.check_tensor("x", x, (torch.float32, torch.float16))
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x needs a non-empty last dimension; got shape {tuple(x.shape)}")
    cs.require_cupy()
    cs.check_on_cuda("x", x)
    out = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if out.numel() == 0:
        return out
    with cs.torch_stream(x.device):
        _row_rms_kernel()(cs.as_cupy(x), np.float32(x.shape[-1]), axis=-1, out=cs.as_cupy(out))
    return out
