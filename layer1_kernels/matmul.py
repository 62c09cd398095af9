"""Tiled matrix multiply C = A @ B in Triton, with grouped program ordering.

Shapes: a (M, K), b (K, N) -> c (M, N), in a's dtype (fp16, bf16 or fp32; fp8 e4m3 through
`matmul_fp8`). Any strides: a transposed view is read in place.

What one program does. Program (pid_m, pid_n) owns one BLOCK_M x BLOCK_N tile of C. It walks
K in steps of BLOCK_K: loads a BLOCK_M x BLOCK_K tile of A and a BLOCK_K x BLOCK_N tile of B,
and accumulates their product into an fp32 register tile with `tl.dot` (tensor cores: wgmma
on Hopper; fp32 inputs go through tf32 on the GPU, exact fp32 in the CPU interpreter). At
the end the tile is cast to the output dtype and stored once. Triton software-pipelines the
loop (`num_stages` tiles in flight in shared memory) so the loads of step k+1.. overlap the
math of step k.

Why it is fast: a loaded A tile is used against all BLOCK_N columns of the C tile and a B
tile against all BLOCK_M rows, so each K step does BLOCK_M*BLOCK_N/(BLOCK_M+BLOCK_N) FLOPs
per byte loaded (85 for 128x256 bf16 tiles), and those loads mostly hit L2, shared by the
programs running at the same time; HBM sees each panel about once per wave. The tensor
cores, not memory, set the pace.

Why grouped ordering. Programs launch roughly in pid order, ~one per SM at a time. In
row-major order (pid_n fastest) the resident programs span a few tile-rows across the
full width of C: they share a few A row-panels but each needs its own B column-panel, so
B is streamed from HBM again for every few tile-rows. Grouped ordering walks C in
super-rows of GROUP_M tile-rows, column by column inside the super-row: the resident
programs cover a roughly square GROUP_M x (SMs/GROUP_M) patch of C, touching GROUP_M
A-panels and ~SMs/GROUP_M B-panels, which stay in L2 and are re-read from there. Same
FLOPs, fewer HBM bytes. How much that buys depends on how close the kernel is to the
bandwidth roof: at 8192^3 bf16 with 128x256 tiles on an H100, even row-major order needs
only ~1.3 TB/s of its 3.35, and GROUP_M in 1..32 measured within run-to-run noise (+-5%);
on chips with less bandwidth per FLOP, or with smaller tiles, grouping shows.

Hopper path (`_matmul_tma_kernel`, fp16/bf16 on compute capability 9.x): the same tiles and
the same grouped order, with two changes that take work off the tensor cores' critical path.
1. TMA loads. Each operand is described once to the Tensor Memory Accelerator (a tensor
   descriptor: base, shape, strides, tile shape); `desc.load([row, col])` then has the copy
   engine fetch a whole tile into shared memory. No per-element address arithmetic or masks
   in registers: out-of-bounds rows/columns of a ragged edge tile come back as zeros (so K
   needs no mask either), and out-of-bounds parts of a stored C tile are simply dropped.
2. A persistent grid: one program per SM, each walking tiles pid, pid+P, pid+2P, ... so an
   SM does not idle between one program's exit and the next one's start. The loop over
   tiles and the K loop are flattened into one software pipeline, so the loads of the next
   tile are issued while the current tile's epilogue (convert + store) runs.
TMA needs one unit stride per operand and 16-byte-aligned base and row pitch. Each operand
may be row-major or column-major (a `w.T` view of an nn.Linear weight is read in place;
A_T/B_T say which); anything else, fp32 (tf32), other GPUs and the CPU interpreter use the
pointer kernel above.

Measured (H100, bf16, do_bench median, two runs), TFLOP/s and ratio to cuBLAS:
  4096^3: cuBLAS 723; pointer kernel 625-645 (0.86-0.89x); TMA persistent 703-713 (0.97-0.99x)
  8192^3: cuBLAS 679; pointer kernel 617-623 (0.91-0.92x); TMA persistent 681-689 (1.00-1.01x)
The TMA tuner picked 128x256x64, 3 stages, 8 warps at both sizes. Of its two changes, TMA loads
carry most of the gain: the same kernel on a full grid (one tile per program) gave 682 and
680. The persistent grid added ~4% at 4096^3 (4 waves of tiles) and nothing measurable at
8192^3; flatten=True measured within noise (+-2%) of a plain nested loop. fp8 e4m3 (pointer
kernel) at 8192^3: ~1150-1240 TFLOP/s, 0.94-0.98 of torch._scaled_mm.

FLOPs: 2*M*N*K.  Bytes (the floor: each input read once, the output written once):
(M*K + K*N) * in_itemsize + M*N * out_itemsize.
"""
from __future__ import annotations

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET on CPU)
from .inputs import check_operand_pair

# isort: split
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8 = getattr(torch, "float8_e4m3fn", None)


def _config(bm: int, bn: int, bk: int, group: int, stages: int, warps: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group},
        num_stages=stages, num_warps=warps,
    )


def _configs(fp8: bool = False) -> list[triton.Config]:
    if interpreter.INTERPRETED:
        # The interpreter runs each config for real (numpy): one small tile, no tuning.
        return [_config(16, 16, 16, 2, 1, 1)]
    bk = 128 if fp8 else 64  # fp8 tiles are half the bytes: a deeper K step fits the same smem
    return [  # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps)
        _config(128, 256, bk, 8, 3, 8),  # the H100's pick for bf16 at 4096^3 and 8192^3
        _config(256, 128, bk, 8, 3, 8),
        _config(128, 128, bk, 8, 4, 8),
        _config(128, 128, bk, 8, 4, 4),
        _config(128, 64, bk, 8, 4, 4),
        _config(64, 128, bk, 8, 4, 4),
    ]


@triton.jit
def _k_step(acc, a_ptrs, b_ptrs, k_left, offs_k, INPUT_PRECISION: tl.constexpr,
            B_T: tl.constexpr):
    """acc += A_tile @ B_tile for one BLOCK_K step; only the last step is ragged
    (k_left < BLOCK_K). B_T: B is stored as B^T (N, K), nn.Linear's layout (the int8
    kernel's weight): its (BLOCK_N, BLOCK_K) tile is converted to A's dtype (exact from int8)
    and transposed in registers."""
    a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
    if B_T:
        b = tl.load(b_ptrs, mask=offs_k[None, :] < k_left, other=0)
        b = tl.trans(b.to(a.dtype))
    else:
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def _tile_product(a_ptr, b_ptr, offs_m, offs_n, offs_k, K,
                  stride_am, stride_ak, stride_bk, stride_bn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr, B_T: tl.constexpr):
    """The main loop of a tiled matmul: A[offs_m, :] @ B[:, offs_n] as a (BLOCK_M, BLOCK_N)
    fp32 tile, BLOCK_K of K at a time (offs_k: one step's K offsets). B_T: see `_k_step`."""
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    if B_T:
        b_ptrs = b_ptr + offs_n[:, None] * stride_bn + offs_k[None, :] * stride_bk
    else:
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = _k_step(acc, a_ptrs + k0 * stride_ak, b_ptrs + k0 * stride_bk, K - k0,
                      offs_k, INPUT_PRECISION, B_T)
    return acc


@triton.jit
def _tile_coords(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Grouped ordering: tile index -> (pid_m, pid_n), GROUP_M tile-rows per super-row."""
    per_group = GROUP_M * tiles_n                  # tiles in one super-row
    first_m = (tile // per_group) * GROUP_M
    rows_here = tl.minimum(tiles_m - first_m, GROUP_M)  # the last super-row may be short
    local = tile % per_group
    return first_m + local % rows_here, local // rows_here  # down the super-row, then right


@triton.jit
def _tile_offsets(pid_m, pid_n, M, N,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The (pid_m, pid_n) tile's row and column offsets, and the K offsets of one step.
    Rows/cols past the edge wrap (modulo) instead of being masked: the loads stay in bounds
    and unmasked along M/N; the wrapped results are simply never stored (`_store_tile`).
    (The int8 kernel's tiles are laid out the same way.)"""
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    return offs_m, offs_n, tl.arange(0, BLOCK_K)


@triton.jit
def _store_tile(c_ptr, acc, pid_m, pid_n, M, N, stride_cm, stride_cn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store the fp32 tile acc as C's (pid_m, pid_n) tile, in C's dtype; the rows and columns
    past the edge (wrapped by `_tile_offsets`) are masked off."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, scale_a_ptr, scale_b_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, INPUT_PRECISION: tl.constexpr, HAS_SCALE: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m, offs_n, offs_k = _tile_offsets(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    acc = _tile_product(a_ptr, b_ptr, offs_m, offs_n, offs_k, K,
                        stride_am, stride_ak, stride_bk, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, False)
    if HAS_SCALE:  # fp8: per-tensor dequantization scales, applied once in the epilogue
        acc = acc * (tl.load(scale_a_ptr) * tl.load(scale_b_ptr))

    _store_tile(c_ptr, acc, pid_m, pid_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N)


# One kernel, two tuners: the fp8 one searches deeper K steps.
_matmul_tuned = triton.autotune(configs=_configs(), key=["M", "N", "K"])(_matmul_kernel)
_matmul_fp8_tuned = triton.autotune(configs=_configs(fp8=True), key=["M", "N", "K"])(_matmul_kernel)


@triton.jit
def _matmul_tma_kernel(
    a_desc, b_desc, c_desc, M, N, K,
    A_T: tl.constexpr, B_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr,
):
    """Persistent TMA matmul (Hopper). a_desc/b_desc/c_desc are TMA tensor descriptors.

    A_T: a_desc describes A^T (K, M) row-major, i.e. A is column-major; it hands out
    (BLOCK_K, BLOCK_M) tiles, transposed here for free (wgmma reads either orientation from
    shared memory). Likewise B_T: b_desc describes B^T (N, K), tiles (BLOCK_N, BLOCK_K).
    c_desc hands out (BLOCK_M, BLOCK_N // EPILOGUE_SPLIT) tiles of C.
    """
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # One program per SM; program p does tiles p, p + P, p + 2P, ... (P = programs launched).
    # flatten=True merges this loop and the K loop into one pipelined loop: the first K
    # tiles of the next C tile are already in flight while this one is stored.
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=True):
        pid_m, pid_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):  # ragged last K step: TMA fills past-the-end with 0
            if A_T:
                a = a_desc.load([k, off_m]).T
            else:
                a = a_desc.load([off_m, k])
            if B_T:
                b = b_desc.load([off_n, k]).T
            else:
                b = b_desc.load([k, off_n])
            acc = tl.dot(a, b, acc)

        # Epilogue: convert and store through TMA (rows/cols past M/N are not written).
        # EPILOGUE_SPLIT=2 stores two (BLOCK_M, BLOCK_N/2) halves: half the shared-memory
        # staging buffer for C, leaving room for one more pipeline stage.
        if EPILOGUE_SPLIT == 2:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            c_desc.store([off_m, off_n], left.to(c_desc.dtype))
            c_desc.store([off_m, off_n + BLOCK_N // 2], right.to(c_desc.dtype))
        else:
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


def _tma_config(bm: int, bn: int, bk: int, stages: int, warps: int, split: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "EPILOGUE_SPLIT": split},
        num_stages=stages, num_warps=warps, pre_hook=_set_tma_blocks,
    )


def _set_tma_blocks(nargs: dict) -> None:
    """Before each launch (autotuner pre_hook): give the descriptors this config's tile shapes."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bk, bm] if nargs["A_T"] else [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["B_T"] else [bk, bn]
    nargs["c_desc"].block_shape = [bm, bn // nargs["EPILOGUE_SPLIT"]]


# Shared memory per config: stages * (A tile + B tile) + the C staging tile; 128x256x64 with
# 3 stages is 3*48 + 64 = 208 KB of the H100's 227 KB (4 stages fit only with a split epilogue).
_TMA_CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, EPILOGUE_SPLIT)
    _tma_config(128, 256, 64, 3, 8, 1),  # the H100's picks at 4096^3 and 8192^3: these two,
    _tma_config(128, 256, 64, 3, 8, 2),  # within noise of each other
    _tma_config(128, 256, 64, 4, 8, 2),
    _tma_config(256, 128, 64, 3, 8, 1),
    _tma_config(128, 128, 64, 4, 4, 1),  # smaller tiles: more programs for mid-size problems
    _tma_config(64, 128, 64, 4, 4, 1),   # for few rows (small M)
]
_TMA_KEY = ["M", "N", "K", "A_T", "B_T"]
_matmul_tma_tuned = triton.autotune(configs=_TMA_CONFIGS, key=_TMA_KEY)(_matmul_tma_kernel)


def _tma_layout(t: torch.Tensor) -> bool | None:
    """How TMA can read 2-D t: False row-major, True column-major (read as t.T), None not at all.

    TMA wants one dimension with unit stride and the other's stride (the row pitch) and the
    base address 16-byte aligned.
    """
    for transposed, (unit, pitch) in ((False, (1, 0)), (True, (0, 1))):
        if (t.stride(unit) == 1 and t.stride(pitch) > 0
                and (t.stride(pitch) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0):
            return transposed
    return None


def _use_tma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> bool:
    return (not interpreter.INTERPRETED and a.is_cuda
            and torch.cuda.get_device_capability(a.device)[0] == 9  # Hopper, where it is tuned
            and a.dtype in (torch.float16, torch.bfloat16) and a.shape[1] > 0
            and _tma_layout(a) is not None and _tma_layout(b) is not None
            and _tma_layout(c) is False)


def _launch_tma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    def describe(t: torch.Tensor, transposed: bool) -> TensorDescriptor:
        t = t.T if transposed else t  # now row-major; block_shape is set per config
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1])

    M, K = a.shape
    N = b.shape[1]
    a_t, b_t = _tma_layout(a), _tma_layout(b)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count

    def grid(meta: dict) -> tuple[int]:  # persistent: at most one program per SM
        return (min(sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)

    _matmul_tma_tuned[grid](describe(a, a_t), describe(b, b_t), describe(c, False), M, N, K,
                            A_T=a_t, B_T=b_t)
    return c


def _check_operands(a: torch.Tensor, b: torch.Tensor, dtypes: tuple) -> None:
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"matmul needs 2-D a (M, K) and b (K, N); got shapes {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    check_operand_pair("a", a, "b", b, dtypes)


def _launch(
    tuner,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
) -> torch.Tensor:
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        return c
    # tf32 on tensor cores for fp32 inputs on the GPU; exact fp32 ("ieee") in the interpreter.
    precision = "ieee" if interpreter.INTERPRETED else "tf32"
    has_scale = scale_a is not None

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    tuner[grid](
        a, b, c, scale_a if has_scale else a, scale_b if has_scale else a,
        M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        INPUT_PRECISION=precision, HAS_SCALE=has_scale,
    )
    return c


def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch reference: a @ b accumulated in fp32 (fp64 stays fp64), returned in a's dtype."""
    acc = torch.promote_types(a.dtype, torch.float32)
    return (a.to(acc) @ b.to(acc)).to(a.dtype)


def matmul(a: torch.Tensor, b: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """C = A @ B. a (M, K), b (K, N), fp16/bf16/fp32, same device -> (M, N) in a's dtype.

    impl: "auto" (Triton on CUDA tensors, torch on CPU), "triton" (our kernel; interpreted on
    CPU), "torch" (`matmul_reference`).
    """
    _check_operands(a, b, _DTYPES if impl != "torch" else _DTYPES + (torch.float64,))
    if not interpreter.use_triton(impl, a, "matmul"):
        return matmul_reference(a, b)
    interpreter.refuse_interpreted_bf16_dot(a.dtype)
    c = torch.empty((a.shape[0], b.shape[1]), device=a.device, dtype=a.dtype)
    if c.numel() > 0 and _use_tma(a, b, c):
        return _launch_tma(a, b, c)
    return _launch(_matmul_tuned, a, b, c)
