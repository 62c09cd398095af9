"""Paged decode attention in Triton: one new query per sequence against keys that live in
scattered cache blocks, read in place through each sequence's block table.

Shapes: q (B, Hq, D); k_cache, v_cache (num_blocks, block_size, Hkv, D); block_tables
(B, max_blocks) int32/int64; seq_lens (B,) int32/int64 -> out (B, Hq, D) in q's dtype.
Sequence b's key at position j lives in block block_tables[b, j // block_size], row
j % block_size. The query is the sequence's last token (position seq_lens[b] - 1, its k, v
already written), so it sees every key j < seq_lens[b] -- and with a sliding window only
j >= seq_lens[b] - window. GQA: query head h uses kv head h // (Hq // Hkv).

What one program loads. Program (b, kv head h, split s) loads the G = Hq / Hkv query heads
that share kv head h as one (G, D) tile (padded to 16 rows: the smallest tensor-core tile)
and keeps it in registers. It then walks its part of the context BLOCK_N tokens at a time:
for each token it reads the block id from the table (tiny, cached), and loads that token's
D-element k row and v row of head h -- every K/V byte of the context once, for all G query
heads at once (a program per query head would read each byte G times).

What it computes. S = Q K^T (G x BLOCK_N, fp32 accumulation), then the online softmax
(running row max m and sum l in fp32, as in layer 1's FlashAttention):
    m_new = max(m, rowmax(S) * c);  p = exp2(S * c - m_new);  alpha = exp2(m - m_new)
    l = l * alpha + rowsum(p);      acc = acc * alpha + p @ V,     c = scale * log2(e)

Why split the context (flash-decoding). A decode batch has only B * Hkv (sequence, kv head)
pairs: at batch 1 on Llama-3.2-1B that is 8 programs for a GPU with 132 SMs -- 6 % of the
chip streaming memory. So the context is cut into `num_splits` contiguous parts, each a
program of its own, writing a partial result (acc / l, and lse = m + log2(l)); a second
tiny kernel merges the parts of each head:
    out = sum_s 2^(lse_s - M) * o_s / sum_s 2^(lse_s - M),   M = max_s lse_s
which is exactly the softmax over the whole context. The split count is chosen on the host
from B, Hkv, the table's capacity and the SM count (never from seq_lens, which live on the
device: reading them would stall the GPU and break CUDA-graph capture); each sequence's
parts are cut from its own length on the device. With one split the first kernel writes
the output directly and the second is skipped.

Why it is fast: decode attention does 4 * D FLOPs per 4 * D bytes of K/V (bf16), an
arithmetic intensity of ~1 FLOP/byte -- far below any GPU's ridge point -- so the only goal
is to stream K/V at copy bandwidth: every byte read once, enough programs in flight to fill
the memory system, no padded copy of the cache (the torch reference gathers one).

Bytes per call (the fewest): (2 * B * Hq * D) * itemsize [q, out]
    + 2 * sum_b(visible_b) * Hkv * D * itemsize [k, v] + B * max_blocks * table itemsize,
plus 2 * B * Hq * num_splits * (D + 1) * 4 for the partial results when split.
FLOPs: 4 * sum_b(visible_b) * Hq * D (two matmul-vector products per query head).
"""
from __future__ import annotations

import functools

import torch

import layer3_model as l3  # first: importing it sets TRITON_INTERPRET on a machine without CUDA

# isort: split
import triton
import triton.language as tl

from .paged_attention_reference import (  # re-exported: the kernel's reference and cost model
    _check,
    decode_bytes_and_flops,
    paged_decode_attention_reference,
)

__all__ = ["paged_decode_attention", "paged_decode_attention_reference", "pick_num_splits",
           "decode_bytes_and_flops"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_HEAD_DIMS = (16, 32, 64, 128, 256)
_LOG2E = 1.4426950408889634
_MIN_SPLIT_TOKENS = 256  # a split shorter than this spends more on its partial result than it saves
_MAX_SPLITS = 64
_PROGRAMS_PER_SM = 8  # (sequence, kv head, part) programs per SM the split count aims for


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, window, kv_group, max_blocks,
    stride_qb, stride_qh, stride_qd,
    stride_kblk, stride_ktok, stride_kh, stride_kd,
    stride_vblk, stride_vtok, stride_vh, stride_vd,
    stride_tb, stride_tc, stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, WINDOWED: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h_kv = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    # This sequence's visible keys [lo, hi) and this program's part of them [start, end).
    hi = tl.load(seq_lens_ptr + b).to(tl.int32)
    hi = tl.maximum(tl.minimum(hi, max_blocks * PAGE), 0)  # never read past the table
    lo = hi * 0
    if WINDOWED:
        lo = tl.maximum(hi - window, 0)
    part = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * part
    end = tl.minimum(start + part, hi)

    # The G query heads of kv head h_kv: one (BLOCK_G, D) tile, padding rows masked.
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = h_kv * kv_group + offs_g
    head_ok = offs_g < kv_group
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=head_ok[:, None], other=0.0)

    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32)
    table = tables_ptr + b * stride_tb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        # token n -> (its block, its row in the block) -> where its k, v rows start
        block = tl.load(table + (offs_n // PAGE) * stride_tc, mask=valid, other=0).to(tl.int64)
        row = offs_n % PAGE
        k_rows = k_ptr + block * stride_kblk + row * stride_ktok + h_kv * stride_kh
        v_rows = v_ptr + block * stride_vblk + row * stride_vtok + h_kv * stride_vh
        k = tl.load(k_rows[:, None] + offs_d[None, :] * stride_kd, mask=valid[:, None], other=0.0)
        v = tl.load(v_rows[:, None] + offs_d[None, :] * stride_vd, mask=valid[:, None], other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # (BLOCK_G, BLOCK_N) fp32
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block holds a valid key
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)  # rescales what was summed under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        m_i = m_new

    seen = l_i > 0.0  # false for an empty part (or an empty sequence): its output is 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:  # partial results, contiguous (B, Hq, NUM_SPLITS, D) and (B, Hq, NUM_SPLITS)
        rows = (b * kv_group * tl.num_programs(1) + heads) * NUM_SPLITS + split
        tl.store(part_o_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], o, mask=head_ok[:, None])
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + rows, lse, mask=head_ok)


@triton.jit
def _merge_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, Hq, stride_ob, stride_oh, stride_od,
                         HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """out[b, h] = the lse-weighted mean of head h's partial results (one program per head)."""
    row = tl.program_id(0).to(tl.int64)  # = b * Hq + h
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    in_range = offs_s < NUM_SPLITS
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + offs_s, mask=in_range, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every part empty: weights 0, output 0
    w = tl.math.exp2(lse - top)
    o = tl.load(part_o_ptr + (row * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                mask=in_range[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    b, h = row // Hq, row % Hq
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty))


# ---- host side -------------------------------------------------------------------------------
@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_num_splits(batch: int, kv_heads: int, max_context: int, device: torch.device) -> int:
    """How many parts to cut each context into: enough (sequence, kv head, part) programs for
    ~8 per SM, but no part shorter than _MIN_SPLIT_TOKENS tokens. Host ints only.
    (H100 sweep, 2026-11-23: at batch 128 two parts beat one by 10-20 % at every context, which
    4 programs per SM did not choose; batch 32 wants 2-5, batch 1-4 as many as the context
    allows.)"""
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 1
    wanted = triton.cdiv(_PROGRAMS_PER_SM * sms, batch * kv_heads)
    return max(1, min(wanted, triton.cdiv(max_context, _MIN_SPLIT_TOKENS), _MAX_SPLITS))


def _pick_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Tokens per loop step and launch shape. Not autotuned: decode shapes change every step.
    (Untuned on a GPU so far: bench_paged_decode's split sweep is the place to tune.)"""
    if l3.INTERPRETED:
        return {"BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    # 4-byte tiles: keep K and V stages in shared memory
    if dtype == torch.float32 and head_dim >= 128:
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           window: int | None = None, impl: str = "auto", *,
                           num_splits: int | None = None) -> torch.Tensor:
    """softmax(q K^T * scale) V for one new query per sequence, K/V read through block tables.

    q (B, Hq, D) (any strides); k_cache, v_cache (num_blocks, block_size, Hkv, D);
    block_tables (B, max_blocks) and seq_lens (B,), int32 or int64, on q's device. Sequence b
    sees keys at positions [max(0, seq_lens[b] - window), seq_lens[b]) (window None: from 0).
    Returns (B, Hq, D) in q's dtype; a sequence with no visible key gets 0.

    The kernel never copies to the host: the context is bounded by max_blocks * block_size
    (seq_lens past it are clamped), so block_tables should be no wider than the longest
    sequence needs. Block ids must be valid for the cache (not checked: that would sync).
    impl: "auto" (Triton on CUDA tensors, the torch reference elsewhere), "triton" (our
    kernel; Triton's interpreter on a CPU), "torch". num_splits: parts per context
    (flash-decoding; default pick_num_splits). fp16/bf16/fp32, D in 16..256, power of two.
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens, scale, window)
    if not l3.use_triton(impl, q, "paged_decode_attention"):
        return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                window)
    B, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    if q.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {q.dtype} for the Triton kernel: expected one of "
                         f"{_DTYPES}")
    if D not in _HEAD_DIMS:
        raise ValueError(f"head dim {D} unsupported by the Triton kernel: expected one of "
                         f"{_HEAD_DIMS}")
    l3.refuse_interpreted_bf16_dot(q.dtype)
    if Hkv > 65535:  # grid axis 1 holds the kv heads; CUDA caps it at 65535
        raise ValueError(f"{Hkv} kv heads exceed the 65535 a launch grid axis holds")
    out = torch.empty((B, Hq, D), device=q.device, dtype=q.dtype)
    max_blocks = block_tables.shape[1]
    if out.numel() == 0 or max_blocks == 0 or page == 0:
        return out.zero_()
    splits = num_splits
    if splits is None:
        splits = pick_num_splits(B, Hkv, max_blocks * page, q.device)
    if not 1 <= splits <= 65535:
        raise ValueError(f"num_splits must be in [1, 65535]; got {splits}")
    if splits > 1:
        part_o = torch.empty((B, Hq, splits, D), device=q.device, dtype=torch.float32)
        part_lse = torch.empty((B, Hq, splits), device=q.device, dtype=torch.float32)
    else:
        part_o = part_lse = out  # unused
    group = Hq // Hkv
    cfg = _pick_config(D, q.dtype)
    _paged_decode_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_lse,
        float(scale) * _LOG2E, int(window or 0), group, max_blocks,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        HEAD_DIM=D, PAGE=page, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=cfg["BLOCK_N"], NUM_SPLITS=splits, WINDOWED=window is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if splits > 1:
        _merge_splits_kernel[(B * Hq,)](
            part_o, part_lse, out, Hq, *out.stride(),
            HEAD_DIM=D, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
            num_warps=1 if l3.INTERPRETED else 2,
        )
    return out
