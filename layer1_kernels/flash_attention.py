"""FlashAttention-2 forward in Triton: softmax(Q K^T * scale) V without materialising the scores.

Shapes: q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) -> out (B, Hq, Nq, D) in q's dtype.
D in {16, 32, 64, 128}; any Nq, Nk (ragged tails are masked); any strides, so a
(B, N, H, D) tensor viewed with .transpose(1, 2) is read in place.

GQA: Hq must be a multiple of Hkv; query head h reads kv head h // (Hq // Hkv).

Causal masking is aligned bottom-right: query i sees keys j <= i + (Nk - Nq). With Nq == Nk
that is the usual lower triangle; with Nq < Nk the queries are the *last* Nq positions of
the sequence (decode or chunked prefill against a KV prefix). With Nq > Nk the first
Nq - Nk queries see no key at all: their output is defined as 0 (the reference agrees).

What one program does. Program (m, b*Hq + h) loads one BLOCK_M x D tile of queries once
and keeps it in registers, then walks the keys BLOCK_N at a time: S = Q K^T on tensor cores
(fp32 accumulate), then the *online softmax* -- a running row max m and row sum l in fp32:
  m_new = max(m, rowmax(S) * c);  p = exp2(S * c - m_new);  alpha = exp2(m - m_new)
  l = l * alpha + rowsum(p);      acc = acc * alpha + p @ V
where c = scale * log2(e), so one multiply-add and the fast exp2 replace exp. At the end
out = acc / l is written once. K and V are read once per query block; the Nq x Nk scores
never touch memory.

The key loop is split in two: blocks every row of the tile may see run with no masks; the
remaining ones (the causal diagonal, the ragged last block) apply the masks. Causal
programs stop at the diagonal, skipping fully-masked blocks (half the work when Nq == Nk),
and the grid launches the longest (bottom) query blocks first so the tail of the launch is
short work. Query blocks of one head are adjacent in the grid, so they share K/V in L2.
That "longest first" holds within a head only: head h's short top blocks launch before head
h + 1's long bottom ones, so at one sequence and few programs a wave (a lone 2048-token
prompt: 512 programs for 132 SMs) the last heads' long blocks start late and run alone at
the end. The HEADS_FIRST order (config key; CAUSAL_HEADS_FIRST picks it for causal launches)
swaps the grid's axes: every head's bottom block first, then every head's next one, which
is longest-first over the whole launch (what FlashAttention-3's causal scheduler does), at
the price of K/V reuse in L2 between neighbouring programs (at 2048 tokens all of K/V is
a few MB, well inside L2). On an H100 it took a lone 2048-token prompt's attention (1B
shape, D 64) from 66 to 50 us a layer and the prefill through the engine from 64 to 67 % MFU.

Measured (H100, bf16, B=4, Hq=32, N=4096, D=128): causal 425-450 TFLOP/s, 1.3-1.4x PyTorch
SDPA's FlashAttention-2 backend (GQA Hkv=8 alike); non-causal ~480 TFLOP/s. Decode
(Nq=1, Nk=4096, B=8, Hq=32, Hkv=8) streams K/V at ~1.7 TB/s: one program per (query
block, head) walks all of Nk alone; splitting Nk across programs (flash-decoding) would
be the next step for long contexts at small batch.

FLOPs: 4 * B * Hq * Nq * Nk * D (two matmuls), halved for causal with Nq == Nk.
Bytes: (B*Hq*Nq*D [q] + 2*B*Hkv*Nk*D [k, v] + B*Hq*Nq*D [out]) * itemsize.
"""
from __future__ import annotations

import math

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET on CPU)

# isort: split
import triton
import triton.language as tl

from .env import env_switch
from .host import cdiv

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HEAD_DIMS = (16, 32, 64, 128)
_LOG2E = 1.4426950408889634
#: Causal launches in the HEADS_FIRST grid order (module docstring): on since the GPU sweep
#: (benchmarks/prefill_attention_sweep.py, BENCHMARKS.md) found it as fast or faster for the
#: table's own tiles at every prefill shape measured; LLM_STACK_FLASH_HEADS_FIRST=0 turns it off.
CAUSAL_HEADS_FIRST = env_switch("LLM_STACK_FLASH_HEADS_FIRST", True)
_MAX_GRID_Y = 65535  # CUDA's cap on grid axis 1 (HEADS_FIRST puts the query blocks there)


@triton.jit
def _online_softmax_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, Nk, causal_offset,
                         qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                         PRECISION: tl.constexpr):
    """Fold one block of keys (offs_n, read at k_ptrs and v_ptrs: (BLOCK_N, D) pointer tiles)
    into the running (acc, l, m) of one query tile (queries offs_m): S = Q K^T, masked when
    MASKED (keys >= Nk, not loaded; with CAUSAL, keys past query i + causal_offset), then the
    online softmax update. Returns (acc, l, m)."""
    if MASKED:
        in_bounds = offs_n < Nk
        k = tl.load(k_ptrs, mask=in_bounds[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=in_bounds[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N) fp32
    if MASKED:
        keep = in_bounds[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if MASKED:
        # A row that has so far seen only masked keys keeps m = -inf; subtracting -inf
        # would give exp2(nan). Subtract 0 instead: its p and alpha come out 0.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new  # unmasked blocks come first: m is finite after the first one
    p = tl.math.exp2(s * qk_scale - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)  # rescales what was summed under the old max
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_block(acc, l_i, m_i, q, k_base, v_base, offs_m, start_n, Nk, causal_offset,
                  qk_scale, stride_kn, stride_kd, stride_vn, stride_vd,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """Fold keys [start_n, start_n + BLOCK_N) into the running (acc, l, m) of one query tile."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    return _online_softmax_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, Nk,
                                causal_offset, qk_scale, MASKED, CAUSAL, PRECISION)


@triton.jit
def _attend_blocks(acc, l_i, m_i, q, k_base, v_base, offs_m, lo, hi, Nk, causal_offset,
                   qk_scale, stride_kn, stride_kd, stride_vn, stride_vd,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                   CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """Fold key blocks [lo, hi) into the running (acc, l, m) of one query tile."""
    for start_n in range(lo, hi, BLOCK_N):
        acc, l_i, m_i = _attend_block(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            offs_m,
            start_n,
            Nk,
            causal_offset,
            qk_scale,
            stride_kn,
            stride_kd,
            stride_vn,
            stride_vd,
            HEAD_DIM,
            BLOCK_N,
            MASKED,
            CAUSAL,
            PRECISION,
        )
    return acc, l_i, m_i


@triton.jit
def _flash_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, qk_scale, Nq, Nk, Hq, kv_group,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, HEADS_FIRST: tl.constexpr,
):
    if HEADS_FIRST:  # grid (B * Hq, query blocks): every head's block i before any block i - 1
        pid_m = tl.program_id(1)
        bh = tl.program_id(0)
        num_m = tl.num_programs(1)
    else:  # grid (query blocks, B * Hq): one head's blocks adjacent (they share K/V in L2)
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        num_m = tl.num_programs(0)
    if CAUSAL:  # bottom query blocks see the most keys: launch them first
        pid_m = num_m - 1 - pid_m
    b = (bh // Hq).to(tl.int64)  # int64: b * stride can pass 2**31 on big batches
    h = bh % Hq
    h_kv = (h // kv_group).to(tl.int64)
    h = h.to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_base = q_ptr + b * stride_qb + h * stride_qh  # this (batch, head)'s queries
    q_ptrs = q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=offs_m[:, None] < Nq, other=0.0)
    k_base = k_ptr + b * stride_kb + h_kv * stride_kh
    v_base = v_ptr + b * stride_vb + h_kv * stride_vh

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)

    causal_offset = Nk - Nq
    if CAUSAL:
        first_row = pid_m * BLOCK_M
        # keys < all_see are visible to every row of the tile; keys >= any_see to none.
        all_see = tl.minimum(tl.maximum(first_row + causal_offset + 1, 0), Nk)
        any_see = tl.minimum(tl.maximum(first_row + BLOCK_M + causal_offset, 0), Nk)
    else:
        all_see = Nk
        any_see = Nk
    unmasked_end = (all_see // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _attend_blocks(
        acc, l_i, m_i, q, k_base, v_base, offs_m, 0, unmasked_end, Nk, causal_offset,
        qk_scale, stride_kn, stride_kd, stride_vn, stride_vd,
        HEAD_DIM, BLOCK_N, False, CAUSAL, PRECISION)
    acc, l_i, m_i = _attend_blocks(
        acc, l_i, m_i, q, k_base, v_base, offs_m, unmasked_end, any_see, Nk, causal_offset,
        qk_scale, stride_kn, stride_kd, stride_vn, stride_vd,
        HEAD_DIM, BLOCK_N, True, CAUSAL, PRECISION)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows that saw no key: acc is 0, output 0
    out = acc / l_i[:, None]
    o_base = o_ptr + b * stride_ob + h * stride_oh
    o_ptrs = o_base + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=offs_m[:, None] < Nq)


def _pick_config(nq: int, head_dim: int, dtype: torch.dtype, causal: bool) -> dict:
    """Tile sizes and launch shape: a fixed table, no autotuning (sequence lengths change every
    decode step; retuning per length would cost more than it saves). From a sweep on an H100,
    bf16, B=4, H=32, N=4096 (TFLOP/s in the comments). HEADS_FIRST: the grid order, for
    causal launches CAUSAL_HEADS_FIRST (module docstring) while the query blocks fit grid axis 1."""
    tiles = _tiles(nq, head_dim, dtype, causal)
    heads_first = causal and CAUSAL_HEADS_FIRST and cdiv(nq, tiles["BLOCK_M"]) <= _MAX_GRID_Y
    return {**tiles, "HEADS_FIRST": heads_first}


def _tiles(nq: int, head_dim: int, dtype: torch.dtype, causal: bool) -> dict:
    if interpreter.INTERPRETED:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    if dtype == torch.float32:  # 4-byte tiles: smaller blocks to fit shared memory
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if (head_dim >= 128 and causal) or nq <= 64:
        # causal D=128: 64-row tiles waste less on the diagonal (448-477; 128x64: 439);
        # decode / short query blocks: less padding (Nq=1, Nk=4096: ~1.7 TB/s of K/V)
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    # D=128: 480, D=64 causal: 407
    return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}


_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
_OPTIONAL_KEYS = ("HEADS_FIRST",)  # absent: False (query blocks of a head adjacent)


def _checked(config: dict) -> dict:
    """A caller's launch config: the four keys, positive ints, power-of-two tiles >= 16, and
    optionally HEADS_FIRST (a bool)."""
    if not set(_CONFIG_KEYS) <= set(config) <= set(_CONFIG_KEYS + _OPTIONAL_KEYS):
        raise ValueError(f"config needs exactly the keys {_CONFIG_KEYS} (optionally "
                         f"{_OPTIONAL_KEYS}); got {sorted(config)}")
    if not isinstance(config.get("HEADS_FIRST", False), bool):
        raise ValueError(f"config['HEADS_FIRST'] must be True or False; got "
                         f"{config['HEADS_FIRST']!r}")
    for key in _CONFIG_KEYS:
        val = config[key]
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"config[{key!r}] must be a positive int; got {val!r}")
    for key in ("BLOCK_M", "BLOCK_N"):
        if config[key] < 16 or config[key] & (config[key] - 1):
            raise ValueError(f"config[{key!r}] must be a power of two >= 16; got {config[key]}")
    return dict(config)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtypes: tuple) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, N, D); got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    (B, Hq, _, D), (Bk, Hkv, Nk, Dk) = q.shape, k.shape
    if B != Bk or D != Dk:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim")
    _check_common(q, k, v, Hq, Hkv, Nk)
    if q.dtype not in dtypes:
        raise ValueError(f"unsupported dtype {q.dtype}: expected one of {dtypes}")


def _check_common(q, k, v, Hq: int, Hkv: int, Nk: int) -> None:
    """The checks both layouts share: GQA head counts, keys present, one dtype, one device."""
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if Nk == 0:
        raise ValueError("k and v hold no keys (Nk == 0)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")


def _check_out(q: torch.Tensor, out: torch.Tensor) -> None:
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must match q: {tuple(q.shape)} {q.dtype} {q.device}; got "
                         f"{tuple(out.shape)} {out.dtype} {out.device}")


def _check_token_major(q, k, v, out) -> None:
    """The checks of the token-major entries (q and out (N, Hq, D); k and v (N, Hkv, D) or a
    paged cache's (num_blocks, page, Hkv, D)) once their dimensions are checked."""
    _check_out(q, out)
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in head dim")
    _check_common(q, k, v, q.shape[1], k.shape[-2], k.shape[0])


def flash_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                              causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Math attention in fp32 (fp64 stays fp64): GQA by repeat_interleave, bottom-right causal."""
    _check(q, k, v, _DTYPES + (torch.float64,))
    acc = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[1]
    kf = k.to(acc).repeat_interleave(group, dim=1)
    vf = v.to(acc).repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q.to(acc) @ kf.transpose(-1, -2)) * scale
    if causal:
        nq, nk = q.shape[2], k.shape[2]
        rows = torch.arange(nq, device=q.device)[:, None]
        cols = torch.arange(nk, device=q.device)[None, :]
        visible = cols <= rows + (nk - nq)
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        p = torch.where(visible.any(dim=-1, keepdim=True), p, 0.0)  # rows with no key -> 0
    else:
        p = torch.softmax(s, dim=-1)
    return (p @ vf).to(q.dtype)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: float | None = None, impl: str = "auto",
                    config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [+ causal mask]) v, FlashAttention-2 style (see module docstring).

    q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D), Hq % Hkv == 0, D in {16, 32, 64, 128},
    fp16/bf16/fp32 (fp32 runs tf32 dots on the GPU). scale defaults to 1/sqrt(D).
    Returns (B, Hq, Nq, D) in q's dtype. impl: "auto" | "triton" | "torch".
    config: tile sizes and launch shape ({"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"})
    instead of the table's pick (for tuning sweeps; see _pick_config).
    out: write the result here (q's shape, dtype and device; any strides, e.g. a (B, Nq, Hq, D)
    buffer viewed with .transpose(1, 2)) and return it: a prefill writes its rows of the
    token-major output in place, with no copy or concatenation afterwards.
    """
    _check(q, k, v, _DTYPES + (torch.float64,))  # bad inputs are reported before a misplaced tensor
    if out is not None:
        _check_out(q, out)
    if not interpreter.use_triton(impl, q, "flash_attention"):
        ref = flash_attention_reference(q, k, v, causal=causal, scale=scale)
        return ref if out is None else out.copy_(ref)
    if q.dtype not in _DTYPES:  # the kernel takes no fp64 (the rest was checked above)
        raise ValueError(f"unsupported dtype {q.dtype}: expected one of {_DTYPES}")
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if D not in _HEAD_DIMS:
        raise ValueError(f"head dim {D} unsupported by the Triton kernel: "
                         f"expected one of {_HEAD_DIMS}")
    interpreter.refuse_interpreted_bf16_dot(q.dtype)
    if B * Hq > 65535:  # grid axis 1 holds (batch, head) pairs; CUDA caps it at 65535
        raise ValueError(f"batch * query heads = {B * Hq} exceeds 65535; split the batch")
    if out is None:
        out = torch.empty((B, Hq, Nq, D), device=q.device, dtype=q.dtype)
    if out.numel() == 0:
        return out
    cfg = None if config is None else _checked(config)
    _launch(q, k, v, out, B, Hq, Hkv, Nq, Nk, D, q.stride(), k.stride(), v.stride(),
            out.stride(), causal, scale, cfg)
    return out


def _launch(q, k, v, out, B, Hq, Hkv, Nq, Nk, D, sq, sk, sv, so, causal, scale, cfg) -> None:
    """The kernel over (B, H, N, D) strides sq, sk, sv, so (checked inputs; cfg None: the
    table's pick)."""
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not scale > 0:  # the running max assumes scaling keeps the order of the scores
        raise ValueError(f"scale must be positive; got {scale}")
    cfg = _pick_config(Nq, D, q.dtype, bool(causal)) if cfg is None else cfg
    heads_first = cfg.get("HEADS_FIRST", False)
    grid = (cdiv(Nq, cfg["BLOCK_M"]), B * Hq)
    if heads_first:
        grid = grid[::-1]
        if grid[1] > _MAX_GRID_Y:
            raise ValueError(f"{grid[1]} query blocks of {cfg['BLOCK_M']} exceed 65535 with "
                             "HEADS_FIRST; use the default grid order")
    _flash_fwd_kernel[grid](
        q, k, v, out, scale * _LOG2E, Nq, Nk, Hq, Hq // Hkv, *sq, *sk, *sv, *so,
        HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=bool(causal),
        PRECISION="ieee" if interpreter.INTERPRETED else "tf32", HEADS_FIRST=heads_first,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def _token_major(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(Nq, H, D) strides as the kernel's (batch, head, row, dim) strides of one sequence."""
    s_n, s_h, s_d = t.stride()
    return 0, s_h, s_n, s_d


def flash_attention_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, *, causal: bool = True,
                           scale: float | None = None, impl: str = "auto",
                           config: dict | None = None) -> torch.Tensor:
    """flash_attention for ONE sequence in the model's token-major layout, written into out:
    q and out (Nq, Hq, D), k and v (Nk, Hkv, D), any strides (rows of a fused qkv output,
    a cache row). The kernel reads the 3-D strides as they are: none of the per-call
    (1, H, N, D) views the 4-D entry needs (host time in every prefill layer).
    Same checks, errors and numbers as flash_attention(q.transpose(0, 1)[None], ...);
    config as there (a tuning sweep times the serving layout with it)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (N, H, D); got shape {tuple(t.shape)}")
    _check_token_major(q, k, v, out)
    (Nq, Hq, D), (Nk, Hkv, _) = q.shape, k.shape
    if not interpreter.use_triton(impl, q, "flash_attention"):
        ref = flash_attention_reference(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        v.transpose(0, 1)[None], causal=causal, scale=scale)
        return out.copy_(ref[0].transpose(0, 1))
    if q.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {q.dtype}: expected one of {_DTYPES}")
    if D not in _HEAD_DIMS:
        raise ValueError(f"head dim {D} unsupported by the Triton kernel: "
                         f"expected one of {_HEAD_DIMS}")
    interpreter.refuse_interpreted_bf16_dot(q.dtype)
    if Hq > 65535:
        raise ValueError(f"query heads = {Hq} exceeds 65535")
    cfg = None if config is None else _checked(config)
    if Nq:
        _launch(q, k, v, out, 1, Hq, Hkv, Nq, Nk, D, _token_major(q), _token_major(k),
                _token_major(v), _token_major(out), causal, scale, cfg)
    return out
