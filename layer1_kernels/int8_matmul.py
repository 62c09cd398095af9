"""Weight-only int8 matmul (W8A16) in Triton: out = x @ (W_int8 * scale)^T, dequantized on the fly.

Shapes: x (M, K) fp16/bf16 (fp32 too), w_int8 (N, K) int8 in nn.Linear layout, scale (N,)
per output channel (fp16/bf16/fp32) -> out (M, N) in x's dtype.

Why: decoding a token multiplies a few activation rows (M = 1..16) by every weight matrix.
That is memory-bound: for K = N = 4096 the FLOPs are 2*M*N*K (33 MFLOP at M=1) but the
weight alone is N*K elements. In bf16 that is 32 MiB per call; in int8 it is 16 MiB, so
the call moves about half the bytes and -- at the same bandwidth -- takes about half the time.

What one program does. Program (m, n) owns a BLOCK_M x BLOCK_N tile of out. It walks K
BLOCK_K at a time: loads the BLOCK_M x BLOCK_K activation tile, the BLOCK_N x BLOCK_K int8
weight tile (1 byte per element from memory), converts the weights to the activation dtype
in registers (exact: every int8 value is representable in fp16 and bf16), and accumulates
x_tile @ w_tile^T in fp32 on the tensor cores. The per-channel scale is constant along K,
so it is applied once, in the epilogue: out[:, n] = acc[:, n] * scale[n].

Tuning for decode: BLOCK_M = 16 (tl.dot's minimum; rows past M wrap and are not stored) and
narrow N tiles (16-64) so that even M = 1 launches 64..256 programs, enough to keep every
SM's memory pipes busy; deep K steps (128-512) and 3-6 pipeline stages keep many weight
loads in flight. Larger M uses bigger tiles, chosen by the autotuner per M bucket.

Measured (H100, bf16, K = N = 4096, CUDA graph replays so launch cost is out): M=1 12.4 us
against 16.6 us for cuBLAS on the bf16 weight (1.34x), M=16 10.6 vs 17.1 us (1.6x). Two
limits: (1) from eager Python a call costs ~65-80 us of Triton launch overhead on the device
VM, several times the kernel, so decode loops should replay CUDA graphs (layer 4); (2) past
M ~ 64 the kernel turns compute-bound and cuBLAS on the dequantized weight wins (M=512:
0.54x) -- the on-the-fly int8 -> bf16 convert sits in the MMA's operand path.

FLOPs: 2*M*N*K.
Bytes: N*K (int8 weight) + M*K*x_itemsize + N*scale_itemsize + M*N*out_itemsize.
"""
from __future__ import annotations

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET on CPU)

# isort: split
import triton
import triton.language as tl

from .matmul import _store_tile, _tile_offsets, _tile_product  # matmul's tiles and main loop

_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk},
                         num_warps=warps, num_stages=stages)


def _configs() -> list[triton.Config]:
    if interpreter.INTERPRETED:
        return [_cfg(16, 16, 32, 1, 1)]
    return [
        # decode: M <= 16
        _cfg(16, 16, 256, 4, 4), _cfg(16, 32, 256, 4, 4), _cfg(16, 32, 128, 4, 4),
        _cfg(16, 64, 128, 4, 4), _cfg(16, 32, 512, 4, 3), _cfg(16, 64, 256, 4, 3),
        _cfg(16, 16, 512, 4, 4), _cfg(16, 32, 512, 8, 4), _cfg(16, 16, 256, 2, 6),
        _cfg(16, 32, 256, 4, 6),
        # small batches: 16 < M <= 64
        _cfg(32, 64, 128, 4, 4), _cfg(64, 64, 128, 4, 4), _cfg(64, 128, 64, 4, 4),
        # prefill: M > 64
        _cfg(128, 128, 64, 8, 4), _cfg(128, 256, 64, 8, 3), _cfg(64, 128, 64, 4, 4),
    ]


def _prune(configs: list[triton.Config], named_args: dict, **_: object) -> list[triton.Config]:
    """Keep the tile heights that fit the M bucket: decode never tries 128-row tiles."""
    mb = named_args["M_BUCKET"]
    lo, hi = (16, 16) if mb <= 16 else (32, 64) if mb <= 64 else (64, 128)
    kept = [c for c in configs if lo <= c.kwargs["BLOCK_M"] <= hi]
    return kept or configs


@triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit(do_not_specialize=["M_BUCKET"])
def _w8a16_kernel(
    x_ptr, w_ptr, s_ptr, o_ptr, M, N, K,
    M_BUCKET,  # M rounded up to a power of two: the autotuner's key, unused by the kernel
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)  # m fastest: programs sharing one weight panel run together
    pid_n = tl.program_id(1)
    # wrapped past the edges (modulo): the loads need no M/N masks; wrapped rows aren't stored
    offs_m, offs_n, offs_k = _tile_offsets(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    # matmul's main loop with B = w^T read in w's (N, K) layout: each int8 tile is loaded
    # (1 byte per element from memory) and converted in registers; the scale waits for the
    # epilogue (constant along K)
    acc = _tile_product(x_ptr, w_ptr, offs_m, offs_n, offs_k, K,
                        stride_xm, stride_xk, stride_wk, stride_wn,
                        BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, True)
    scale = tl.load(s_ptr + offs_n).to(tl.float32)        # per output channel, once
    _store_tile(o_ptr, acc * scale[None, :], pid_m, pid_n, M, N, stride_om, stride_on,
                BLOCK_M, BLOCK_N)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: w (N, K) float -> (w_int8 (N, K), scale (N,)).

    scale[n] = max|w[n, :]| / 127 (1 for an all-zero row, so nothing divides by 0), kept in
    w's dtype; w_int8 = round(w / scale) clamped to [-127, 127], so w ~ w_int8 * scale with
    error at most scale/2 per element.
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_int8 needs a 2-D float weight (N, K); got {w.dtype} "
                         f"{tuple(w.shape)}")
    amax = w.detach().abs().amax(dim=1).to(torch.float32)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).to(w.dtype)
    # Quantize with the scale as stored, so dequantizing reproduces exactly what we rounded.
    q = torch.round(w.detach().to(torch.float32) / scale.to(torch.float32)[:, None])
    return q.clamp_(-127, 127).to(torch.int8), scale


def _check(x: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor, x_dtypes: tuple) -> None:
    if x.dim() != 2 or w_int8.dim() != 2 or scale.dim() != 1:
        raise ValueError(f"int8_matmul needs x (M, K), w_int8 (N, K), scale (N,); got shapes "
                         f"{tuple(x.shape)}, {tuple(w_int8.shape)}, {tuple(scale.shape)}")
    if x.shape[1] != w_int8.shape[1]:
        raise ValueError(f"x has K={x.shape[1]} but w_int8 has K={w_int8.shape[1]} (it is (N, K), "
                         "nn.Linear layout)")
    if scale.shape[0] != w_int8.shape[0]:
        raise ValueError(f"scale has {scale.shape[0]} entries, w_int8 has N={w_int8.shape[0]} rows")
    if w_int8.dtype != torch.int8:
        raise ValueError(f"w_int8 must be torch.int8; got {w_int8.dtype}")
    if x.dtype not in x_dtypes:
        raise ValueError(f"unsupported activation dtype {x.dtype}: expected one of {x_dtypes}")
    if not scale.is_floating_point():
        raise ValueError(f"scale must be floating point; got {scale.dtype}")
    if not (x.device == w_int8.device == scale.device):
        raise ValueError(f"x, w_int8, scale are on different devices: {x.device}, "
                         f"{w_int8.device}, {scale.device}")


def int8_matmul_reference(
    x: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """torch reference: x @ (w_int8 * scale[:, None])^T in fp32 (fp64 stays fp64), in x's dtype."""
    _check(x, w_int8, scale, _X_DTYPES + (torch.float64,))
    acc = torch.promote_types(x.dtype, torch.float32)
    w = w_int8.to(acc) * scale.to(acc)[:, None]
    return (x.to(acc) @ w.T).to(x.dtype)


def int8_matmul(x: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor, *,
                impl: str = "auto") -> torch.Tensor:
    """out = x @ (w_int8 * scale[:, None])^T. x (M, K), w_int8 (N, K), scale (N,) -> (M, N).

    impl: "auto" (Triton on CUDA tensors, torch on CPU) | "triton" | "torch".
    """
    # bad inputs are reported before a misplaced tensor
    _check(x, w_int8, scale, _X_DTYPES + (torch.float64,))
    if not interpreter.use_triton(impl, x, "int8_matmul"):
        return int8_matmul_reference(x, w_int8, scale)
    _check(x, w_int8, scale, _X_DTYPES)  # the kernel takes no fp64
    interpreter.refuse_interpreted_bf16_dot(x.dtype)
    M, K = x.shape
    N = w_int8.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return out

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))

    _w8a16_kernel[grid](
        x, w_int8, scale.contiguous(), out, M, N, K, min(triton.next_power_of_2(M), 256),
        x.stride(0), x.stride(1), w_int8.stride(0), w_int8.stride(1), out.stride(0), out.stride(1),
        PRECISION="ieee" if interpreter.INTERPRETED else "tf32",
    )
    return out
