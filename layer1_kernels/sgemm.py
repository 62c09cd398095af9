"""SGEMM, step by step: C = A @ B in float32 with CUDA C kernels run through CuPy.

Read layer1_kernels/cuda/sgemm_0*.cu in order; each file's header says what changed from
the one before and why it is faster:

    1 naive            one thread per C element, warps walking down rows (uncoalesced)
    2 coalesced        the same, warps walking along rows (coalesced B loads, C stores)
    3 smem_tiled       32 x 32 tiles of A and B staged in shared memory
    4 blocktile_1d     each thread computes 8 outputs of a column from registers
    5 blocktile_2d     each thread computes an 8 x 8 block: outer products in registers
    6 vectorized       float4 global loads/stores, A transposed in shared memory
    7 double_buffered  next slice's loads overlap this slice's math; warp-shaped layout

Shapes: a (M, K), b (K, N) row-major float32 CUDA tensors, any M, N, K; returns (M, N).
FLOPs: 2 M N K. Fewest bytes: 4 (M K + K N + M N). At 4096^3 that is 137 GFLOP against
201 MB: ~680 FLOP per byte, far above the H100's ~20 fp32 FLOP/byte, so SGEMM is
compute-bound and the ceiling is the FP32 FMA rate (~67 TFLOP/s on an H100 SXM).

Versions 6 and 7 load 16 bytes at a time and need K and N to be multiples of 4 (and
16-byte aligned pointers). For other shapes `sgemm` copies A and B into zero-padded
buffers (zeros add nothing to a dot product), runs the kernel on those, and returns the
unpadded C: correct for every shape, at the cost of copying the operands.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import cupy_support as cs
from . import interpreter  # noqa: F401  (layer-1 convention; these kernels do not use Triton)


@dataclass(frozen=True)
class _Version:
    file: str
    kernel: str
    threads: tuple[int, ...]  # block shape
    tile: tuple[int, int]     # (rows, cols) of C per block
    rows_on_x: bool = False   # grid.x walks rows (the naive kernel's deliberate mistake)
    vec4: bool = False        # needs K % 4 == N % 4 == 0 and 16-byte aligned pointers
    options: tuple[str, ...] = ()  # extra NVRTC options, e.g. ("-DBK=16",)


_VERSIONS: dict[str, _Version] = {
    "naive": _Version("sgemm_01_naive.cu", "sgemm_naive", (32, 32), (32, 32), rows_on_x=True),
    "coalesced": _Version("sgemm_02_coalesced.cu", "sgemm_coalesced", (32, 32), (32, 32)),
    "smem_tiled": _Version("sgemm_03_smem_tiled.cu", "sgemm_smem_tiled", (32, 32), (32, 32)),
    "blocktile_1d": _Version("sgemm_04_blocktile_1d.cu", "sgemm_blocktile_1d", (512,), (64, 64)),
    "blocktile_2d": _Version("sgemm_05_blocktile_2d.cu", "sgemm_blocktile_2d", (256,), (128, 128)),
    "vectorized": _Version(
        "sgemm_06_vectorized.cu", "sgemm_vectorized", (256,), (128, 128), vec4=True
    ),
    "double_buffered": _Version(
        "sgemm_07_double_buffered.cu", "sgemm_double_buffered", (256,), (128, 128), vec4=True
    ),
}

#: The versions in the order a student reads them (version i is SGEMM_VERSIONS[i - 1]).
SGEMM_VERSIONS: tuple[str, ...] = tuple(_VERSIONS)
#: The version `version="best"` runs: the fastest at 4096^3 on an H100.
BEST_VERSION = "double_buffered"

_INT_MAX = 2**31 - 1


def resolve_version(version: int | str) -> str:
    """The version's name from 1-based number, name, or "best"; ValueError otherwise."""
    if isinstance(version, bool):
        raise ValueError(f"unknown SGEMM version {version!r}")
    if isinstance(version, int):
        if 1 <= version <= len(SGEMM_VERSIONS):
            return SGEMM_VERSIONS[version - 1]
        raise ValueError(f"SGEMM version number must be 1..{len(SGEMM_VERSIONS)}, got {version}")
    if version == "best":
        return BEST_VERSION
    if version in _VERSIONS:
        return version
    raise ValueError(f"unknown SGEMM version {version!r}; choose a number "
                     f"1..{len(SGEMM_VERSIONS)}, "
                     f"'best' or one of {', '.join(SGEMM_VERSIONS)}")


def sgemm_source(version: int | str) -> str:
    """The CUDA C text of one SGEMM version: a number 1..7, a name from SGEMM_VERSIONS or
    "best". Each file's header says its kernel's name, launch shape and what changed."""
    return cs.read_source(_VERSIONS[resolve_version(version)].file)


def sgemm_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b by torch.matmul in true float32 (TF32 off for this call; cuBLAS on a GPU)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return torch.matmul(a.float(), b.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    cs.check_tensor("a", a, (torch.float32,))
    cs.check_tensor("b", b, (torch.float32,))
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D; got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if max(a.shape[0], a.shape[1], b.shape[1]) > _INT_MAX // 4:
        raise ValueError("each of M, N, K must be below 2**29 for these int-indexed kernels")


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    padded = torch.zeros(rows, cols, dtype=t.dtype, device=t.device)
    padded[: t.shape[0], : t.shape[1]] = t
    return padded


def sgemm(a: torch.Tensor, b: torch.Tensor, *, version: int | str = "best") -> torch.Tensor:
    """C = a @ b with one of our CUDA C SGEMM kernels (see SGEMM_VERSIONS).

    a: (M, K), b: (K, N) float32 tensors on one CUDA device. Returns a new (M, N) float32
    tensor. `version` is a number 1..7, a name from SGEMM_VERSIONS, or "best".
    Raises ValueError for bad shapes, dtypes or versions and RuntimeError without CuPy/GPU.
    """
    name = resolve_version(version)
    _check(a, b)
    cs.require_cupy()
    cs.check_on_cuda("a", a)
    cs.check_on_cuda("b", b)
    if a.device != b.device:
        raise ValueError(f"a and b must be on the same device; got {a.device} and {b.device}")

    spec = _VERSIONS[name]
    (M, K), N = a.shape, b.shape[1]
    a, b = a.contiguous(), b.contiguous()
    if M == 0 or N == 0 or K == 0:
        return torch.zeros(M, N, dtype=torch.float32, device=a.device)

    n_run = N
    if spec.vec4 and (K % 4 or N % 4 or not _aligned(a, b)):
        # Zero-pad K and N up to multiples of 4 in fresh (aligned) buffers.
        k4, n_run = -(-K // 4) * 4, -(-N // 4) * 4
        a, b = _pad_to(a, M, k4), _pad_to(b, k4, n_run)
        K = k4
    c = torch.empty(M, n_run, dtype=torch.float32, device=a.device)

    tile_rows, tile_cols = spec.tile
    row_blocks, col_blocks = -(-M // tile_rows), -(-n_run // tile_cols)
    grid = (row_blocks, col_blocks) if spec.rows_on_x else (col_blocks, row_blocks)
    if grid[1] > 65535:
        raise ValueError(f"matrix too large for a {grid} grid (gridDim.y is at most 65535)")
    index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    kernel = cs.get_kernel(spec.file, spec.kernel, index, spec.options)
    args = (np.int32(M), np.int32(n_run), np.int32(K), cs.as_cupy(a), cs.as_cupy(b), cs.as_cupy(c))
    with cs.torch_stream(a.device):
        kernel(grid, spec.threads, args)
    return c if n_run == N else c[:, :N].contiguous()
