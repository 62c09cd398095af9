"""Lab 1 — kernels: your answers.

Four kernels, in the order `lab1.ipynb` teaches them:

1. `softmax`  — a fused row softmax in Triton (one program per row, masking, a stable max).
2. `rms_norm` — RMSNorm in Triton, optionally fused with the residual add.
3. `matmul`   — a tiled matrix multiply in Triton (a 2-D grid of output tiles, `tl.dot`).
4. `sgemm_source` — a CUDA C kernel: SGEMM with 32 x 32 tiles staged in shared memory.

Write the code where it says YOUR CODE (each public function raises NotImplementedError
until you do). Grade yourself with `stack grade --lab 1`.

Rules the grader enforces (see tests/labs/test_lab1.py):
* The math happens inside YOUR @triton.jit kernels. While your function runs, every torch
  operation other than allocating, viewing, copying and casting tensors raises an error
  (so `torch.softmax`, `x.exp()`, `a @ b`, `torch.rsqrt`, ... earn nothing), and the
  function must launch at least one kernel defined in this file.
* Do not import `layer1_kernels` here: it holds the answers, and the grader refuses it.

On a machine without a GPU, Triton runs kernels through its interpreter (numpy on the
CPU): slow, but the same code and the same answers. `impl` is there so these functions
have the signatures of layer1_kernels'; only impl="triton" is asked of you.
"""
from __future__ import annotations

import os

import torch

# ---- plumbing (read, no need to edit) ------------------------------------------------
# Triton decides between compiling and interpreting when a kernel is *defined*, from
# TRITON_INTERPRET: set it before the first @triton.jit below when there is no GPU.
# (The notebook and the grader also import layer1_kernels, whose interpreter.py fixes
# Triton 3.6's interpreter for numpy >= 2.4: loops to a runtime bound work there too.)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


def _check_impl(impl: str) -> None:
    if impl != "triton":
        raise ValueError(f"only impl='triton' is asked of you in this lab, got {impl!r}")


# ---- Exercise 1: fused softmax -------------------------------------------------------
@triton.jit
def _softmax_kernel(x_ptr, y_ptr, n_cols, BLOCK: tl.constexpr):
    """One program = one row of x (n_cols contiguous values at x_ptr + row * n_cols).

    BLOCK is a power of two >= n_cols: the whole row fits in one block of registers.
      1. row = tl.program_id(0); offsets = tl.arange(0, BLOCK); mask = offsets < n_cols.
      2. Load the row as fp32. Padding lanes (mask False) must not change the answer:
         what `other=` value makes them lose the max and add exp(...) = 0 to the sum?
      3. Subtract the row max before tl.exp (so nothing overflows), divide by the sum.
      4. Store in y's dtype (y_ptr.dtype.element_ty), masked.
    Use tl.int64 for row * n_cols if rows * n_cols can exceed 2**31.
    """
    # YOUR CODE
    pass


def softmax(x: torch.Tensor, *, impl: str = "triton") -> torch.Tensor:
    """Softmax over the last dim of x (..., cols), fp16/bf16/fp32 with fp32 math; returns a
    new tensor of x's shape and dtype.

    Flatten the leading dims into rows (x.contiguous() makes rows back to back), allocate
    the output with torch.empty_like, pick BLOCK = triton.next_power_of_2(cols) and launch
    one program per row: `_softmax_kernel[(rows,)](x, y, cols, BLOCK=BLOCK)`.
    """
    _check_impl(impl)
    # YOUR CODE
    raise NotImplementedError("softmax")


# ---- Exercise 2: RMSNorm, fused with the residual add -------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, h_ptr, w_ptr, y_ptr, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One program = one row (token) of n_cols values; BLOCK = next power of two >= n_cols.

    Without a residual:  y = x / sqrt(mean(x^2) + eps) * w
    With one:            h = x + r (rounded to x's dtype, as an eager `x + r` would be; store
                         it at h_ptr), then y = h / sqrt(mean(h^2) + eps) * w
    Statistics in fp32. Careful: the mean divides by n_cols, not by BLOCK. HAS_RESIDUAL is a
    constexpr: `if HAS_RESIDUAL:` is resolved when the kernel is compiled, so the version
    without a residual never touches r_ptr or h_ptr.
    """
    # YOUR CODE
    pass


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6,
    residual: torch.Tensor | None = None, impl: str = "triton",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x (..., hidden) with weight (hidden,); y has x's shape and dtype.

    Returns y, or with `residual` (x's shape and dtype) the pair (y, h) where h = x + residual
    is the new residual stream of the transformer block: one kernel reads x and residual
    once and writes h and y once, where eager torch would make five passes over memory.
    Launch one program per row. When there is no residual, pass any tensor (x) for r_ptr
    and h_ptr: the kernel never reads them.
    """
    _check_impl(impl)
    # YOUR CODE
    raise NotImplementedError("rms_norm")


# ---- Exercise 3: tiled matmul ----------------------------------------------------------
@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                   stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (pid_m, pid_n) computes the BLOCK_M x BLOCK_N tile of C = A @ B at rows
    pid_m * BLOCK_M.. and columns pid_n * BLOCK_N..

    Keep an fp32 accumulator tile (tl.zeros). Walk K in steps of BLOCK_K: load a
    BLOCK_M x BLOCK_K tile of A and a BLOCK_K x BLOCK_N tile of B (2-D offsets built with
    [:, None] and [None, :], addresses from the strides, masks for every edge: M, N and the
    last, ragged K step, with other=0.0 so padding adds nothing) and accumulate
    `acc = tl.dot(a, b, acc)`. Store acc in C's dtype, masked to the matrix.
    Each loaded element is used BLOCK_N (or BLOCK_M) times: that reuse is the point of tiling.
    """
    # YOUR CODE
    pass


def matmul(a: torch.Tensor, b: torch.Tensor, *, impl: str = "triton") -> torch.Tensor:
    """C = A @ B. a (M, K), b (K, N): fp16 or fp32 (fp32 accumulation), on one device, any
    strides (a transposed view is read in place). Returns a new (M, N) tensor in a's dtype."""
    _check_impl(impl)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul needs a (M, K) and b (K, N); got {tuple(a.shape)} and {tuple(b.shape)}")
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), device=a.device, dtype=a.dtype)
    BLOCK_M, BLOCK_N, BLOCK_K = 32, 32, 32  # tl.dot needs each >= 16; try others on a GPU
    # YOUR CODE: write _matmul_kernel, then delete the raise below (the launch is given).
    raise NotImplementedError("matmul: write _matmul_kernel, then delete this raise")
    # A 2-D grid: one program per BLOCK_M x BLOCK_N tile of C.
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _matmul_kernel[grid](
        a, b, c, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return c


# ---- Exercise 4: a CUDA C kernel, SGEMM with shared-memory tiles ----------------------
#: Your CUDA C source. The grader compiles it with nvcc (sm_90; no GPU needed) and, on a
#: GPU, runs it through CuPy with block (32, 32) and grid (ceil(N / 32), ceil(M / 32)).
SGEMM_SMEM_TILED_CU = r"""
// C = A @ B, row-major float32: A is M x K, B is K x N, C is M x N; any M, N, K.
// Block (32, 32) computes one 32 x 32 tile of C: thread (tx, ty) = (threadIdx.x,
// threadIdx.y) owns C[blockIdx.y * 32 + ty][blockIdx.x * 32 + tx].
#define TILE 32

extern "C" __global__ void sgemm_smem_tiled(int M, int N, int K, const float* __restrict__ A,
                                            const float* __restrict__ B, float* __restrict__ C)
{
    // YOUR CODE:
    // 1. Declare two __shared__ float [TILE][TILE] arrays, one for a tile of A, one of B.
    // 2. Walk K in steps of TILE. At each step every thread copies ONE element of the A tile
    //    and ONE of the B tile into shared memory (zero if it lies past an edge), then
    //    __syncthreads(), then adds its row-of-As times column-of-Bs dot product, then
    //    __syncthreads() again (why is the second barrier needed?).
    // 3. Write the result if (row, col) lies inside C.
}
"""


def sgemm_source(version: int | str = "smem_tiled") -> str:
    """The CUDA C source of the SGEMM kernel `sgemm_smem_tiled` (version 3, "smem_tiled", of
    layer 1's progression: the only one this lab asks for). Signature:
    extern "C" __global__ void sgemm_smem_tiled(int M, int N, int K, const float* A,
    const float* B, float* C). Write it in SGEMM_SMEM_TILED_CU, then return that."""
    if version not in (3, "smem_tiled"):
        raise ValueError(f"this lab asks only for version 3, 'smem_tiled'; got {version!r}")
    # YOUR CODE
    raise NotImplementedError("sgemm_source: write the kernel in SGEMM_SMEM_TILED_CU, then return it")
