"""The MLP's gate_up GEMM with SiLU-and-multiply in its epilogue: one kernel instead of two.

    y = silu(x @ W_gate^T) * (x @ W_up^T),   W = [W_gate; W_up] (2F, K), nn.Linear's weight

Shapes: x (M, K), w (2F, K) -> y (M, F), fp16/bf16 (fp32 too off Hopper), fp32 accumulation;
silu and the product are taken in fp32 from the fp32 accumulators and rounded once.

Why. Prefill runs gate_up as one cuBLAS GEMM that writes (M, 2F) and then `silu_and_mul`
(swiglu.py) reads it back and writes (M, F): at copy bandwidth that is ~33 us a layer for a
1B model's 2048-token prefill, ~7 % of the step. Here the (M, 2F) product never leaves the
chip: each program computes the gate tile and the matching up tile of the same rows and
columns, and stores only silu(gate) * up.

What one program does (the Hopper kernel, layer 1's persistent TMA matmul in matmul.py with
a second accumulator). Tile (pid_m, pid_n) of y covers rows m..m+BM and columns n..n+BN; per
K step it loads one x tile and two weight tiles, rows n..n+BN (gate) and F+n..F+n+BN (up) of
the same (2F, K) descriptor, and issues two `tl.dot`s into two fp32 accumulators. So BN=128
does the work of a 128x256 tile of the plain GEMM (same registers, same shared memory per
stage) but stores a 128x128 tile. Past-the-end gate rows of a ragged last column tile read
into the up half; their columns are beyond F and the store drops them. Persistent grid,
grouped tile order and the flattened tile/K pipeline as in matmul.py.

Off Hopper, for fp32 and in the CPU interpreter: the same two-accumulator tile with pointer
loads (masked K tail, wrapped M/N rows never stored), one program per tile.

Configs: a fixed table by shape (`pick_config`), no autotuning, so the first call of a shape
compiles and never benchmarks (the engine warms up before CUDA-graph capture; an autotuner
would benchmark again for every new token count).

FLOPs: 2 * M * 2F * K (+ ~5 * M * F in the epilogue).
Bytes (the floor): (M*K + 2F*K + M*F) * itemsize.
"""
from __future__ import annotations

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET on CPU)
from .inputs import check_operand_pair
from .matmul import _tile_coords, _tma_layout

# isort: split
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _silu_mul(g, u):
    # g / (1 + exp(-g)): exp overflows to inf for g << 0, giving -0, the right limit.
    return g / (1.0 + tl.exp(-g)) * u


# do_not_specialize M: one compiled kernel serves every token count (Triton would otherwise
# compile again for a count that is not a multiple of 16, possibly first met under capture).
@triton.jit(do_not_specialize=["M"])
def _gemm_swiglu_tma_kernel(x_desc, w_desc, y_desc, M, F, K,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr):
    """Persistent TMA kernel (Hopper). x_desc (M, K) hands out (BM, BK) tiles, w_desc (2F, K)
    (BN, BK) tiles, y_desc (M, F) (BM, BN) tiles."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(F, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=True):
        pid_m, pid_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):  # ragged last K step: TMA fills past-the-end with 0
            a = x_desc.load([off_m, k])
            gate = tl.dot(a, w_desc.load([off_n, k]).T, gate)
            up = tl.dot(a, w_desc.load([F + off_n, k]).T, up)
        y_desc.store([off_m, off_n], _silu_mul(gate, up).to(y_desc.dtype))


@triton.jit(do_not_specialize=["M"])
def _gemm_swiglu_kernel(x_ptr, w_ptr, y_ptr, M, F, K,
                        stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Pointer kernel, one program per (BM, BN) tile of y."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(F, BLOCK_N),
                                GROUP_M)
    # Rows/cols past the edge wrap (modulo): loads stay in bounds, the wrapped results are
    # never stored.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % F
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    g_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    u_ptrs = g_ptrs + F * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = offs_k[None, :] < K - k0
        a = tl.load(x_ptrs + k0 * stride_xk, mask=in_k, other=0.0)
        wg = tl.load(g_ptrs + k0 * stride_wk, mask=in_k, other=0.0)
        wu = tl.load(u_ptrs + k0 * stride_wk, mask=in_k, other=0.0)
        gate = tl.dot(a, tl.trans(wg), gate, input_precision=INPUT_PRECISION)
        up = tl.dot(a, tl.trans(wu), up, input_precision=INPUT_PRECISION)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, _silu_mul(gate, up).to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < F))


#: The interpreter runs every program for real (numpy): small tiles, one stage.
INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1,
                          num_stages=1)
#: The pointer kernel's tile on a GPU (off Hopper, fp32): 128 x 64 outputs, 32 of K a step,
#: which keeps 3 fp32 stages in 96 KB of shared memory.
POINTER_CONFIG = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4,
                      num_stages=3)


def pick_config(M: int, F: int, K: int, sms: int) -> dict:
    """The TMA kernel's tile config for a shape on `sms` SMs: BLOCK_M/N/K, GROUP_M, num_warps,
    num_stages.

    128x128 output tiles (two 128x128 accumulators: the registers and the 48 KB a stage of the
    plain GEMM's 128x256 pick, matmul.py), 3 stages (144 KB + the 32 KB output tile); 64-row
    tiles when 128-row ones would leave SMs idle (fewer tiles than SMs)."""
    bm = 128 if triton.cdiv(M, 128) * triton.cdiv(F, 128) >= sms else 64
    return dict(BLOCK_M=bm, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8 if bm == 128 else 4,
                num_stages=3 if bm == 128 else 4)


def uses_tma(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `gemm_swiglu` takes the persistent TMA kernel for these operands: fp16/bf16 on
    a Hopper GPU (compute capability 9.x), each operand row-major with 16-byte-aligned base and
    row pitch (x (M, K) with K % 8 == 0 for 2-byte dtypes)."""
    return (not interpreter.INTERPRETED and x.is_cuda and x.dim() == 2 and w.dim() == 2
            and torch.cuda.get_device_capability(x.device)[0] == 9
            and x.dtype in (torch.float16, torch.bfloat16) and w.dtype == x.dtype
            and x.shape[1] > 0 and _tma_layout(x) is False and _tma_layout(w) is False)


def _launch_tma(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: dict, sms: int) -> None:
    """The persistent kernel on `sms` programs at most (the interpreter runs it too, on CPU
    tensors: how the tests check its tiling without a GPU)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = x.shape
    F = y.shape[1]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [bm, bk])
    w_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [bn, bk])
    y_desc = TensorDescriptor(y, list(y.shape), list(y.stride()), [bm, bn])
    grid = (min(sms, triton.cdiv(M, bm) * triton.cdiv(F, bn)),)  # persistent: <= one per SM
    _gemm_swiglu_tma_kernel[grid](x_desc, w_desc, y_desc, M, F, K, BLOCK_M=bm, BLOCK_N=bn,
                                  BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
                                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: dict) -> None:
    M, K = x.shape
    F = y.shape[1]
    # tf32 on tensor cores for fp32 inputs on the GPU; exact fp32 ("ieee") in the interpreter.
    precision = "ieee" if interpreter.INTERPRETED else "tf32"
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(F, cfg["BLOCK_N"]),)
    _gemm_swiglu_kernel[grid](x, w, y, M, F, K, x.stride(0), x.stride(1), w.stride(0),
                              w.stride(1), y.stride(0), y.stride(1),
                              BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                              BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
                              INPUT_PRECISION=precision, num_warps=cfg["num_warps"],
                              num_stages=cfg["num_stages"])


def gemm_swiglu_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(x @ w[:F].T) * (x @ w[F:].T) in fp32 (fp64 stays fp64), returned in x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    F = w.shape[0] // 2
    xf, wf = x.to(acc), w.to(acc)
    return (torch.nn.functional.silu(xf @ wf[:F].T) * (xf @ wf[F:].T)).to(x.dtype)


def gemm_swiglu(x: torch.Tensor, w: torch.Tensor, *, impl: str = "auto",
                config: dict | None = None) -> torch.Tensor:
    """silu(x @ w[:F].T) * (x @ w[F:].T) for x (M, K) and w (2F, K) ([gate; up] rows, the
    gate_up nn.Linear's weight as it is): (M, F) in x's dtype, one rounding.

    impl: "auto" (our kernel on CUDA tensors, the reference on CPU), "triton" (our kernel;
    interpreted on a CPU), "torch" (`gemm_swiglu_reference`). config: a `pick_config`-style
    dict to override the table (benchmarks sweep tiles with it).
    """
    if x.dim() != 2 or w.dim() != 2 or w.shape[0] % 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemm_swiglu needs x (M, K) and w (2F, K); got shapes "
                         f"{tuple(x.shape)} and {tuple(w.shape)}")
    check_operand_pair("x", x, "w", w, _DTYPES if impl != "torch" else _DTYPES + (torch.float64,))
    if not interpreter.use_triton(impl, x, "gemm_swiglu"):
        return gemm_swiglu_reference(x, w)
    interpreter.refuse_interpreted_bf16_dot(x.dtype)
    M, K = x.shape
    F = w.shape[0] // 2
    y = torch.empty((M, F), device=x.device, dtype=x.dtype)
    if y.numel() == 0:
        return y
    if K == 0:
        return y.zero_()
    if interpreter.INTERPRETED:
        _launch(x, w, y, config or INTERPRETER_CONFIG)
    elif uses_tma(x, w) and _tma_layout(y) is False:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        _launch_tma(x, w, y, config or pick_config(M, F, K, sms), sms)
    else:
        _launch(x, w, y, config or POINTER_CONFIG)
    return y
