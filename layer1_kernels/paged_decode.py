"""Decode attention over a paged (or contiguous) KV cache, split across the context
(flash-decoding), with the split results merged inside the same launch.

    paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window, num_splits)

q (B, Hq, D); k_cache, v_cache (num_blocks, page, Hkv, D); block_tables (B, max_blocks)
int, or None for a contiguous cache (sequence b is "block" b: pass the cache as
(batch, max_len, Hkv, D), page = max_len); seq_lens (B,) -> out (B, Hq, D) in q's dtype.
Sequence b sees keys [max(0, seq_lens[b] - window), seq_lens[b]); GQA: query head h reads
kv head h // (Hq / Hkv). Layer 4's paged_attention.py documents the algorithm (one program
per (sequence, kv head, part): the G query heads of a kv head as one tile, online softmax
over BLOCK_N keys at a time, partial results (o, lse) per part).

The merge. With more than one part, each program writes its partial result, then takes a
ticket from a per-(sequence, kv head) counter (an atomic add, acquire-release, after a
barrier so every thread's stores come first); the program that draws the last ticket reads
all parts back and writes the lse-weighted mean, then resets the counter to 0 for the next
call. That saves the second launch flash-decoding usually needs (~2-3 us each on a GPU,
x layers per token). The counters live in a buffer kept per device, zero between calls;
when one must be allocated while a CUDA graph is being captured (nothing is allocated
there before the first eager call), the separate merge kernel is used instead.
"""
from __future__ import annotations

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET)

# isort: split
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .gemv import pdl_launch

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr, count_ptr,
    qk_scale, window, kv_group, max_blocks,
    stride_qb, stride_qh, stride_qd,
    stride_kblk, stride_ktok, stride_kh, stride_kd,
    stride_vblk, stride_vtok, stride_vh, stride_vd,
    stride_tb, stride_tc, stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, WINDOWED: tl.constexpr, IDENTITY: tl.constexpr,
    FUSED_MERGE: tl.constexpr, PDL: tl.constexpr, BLOCK_S: tl.constexpr,
):
    if PDL:  # everything below reads what the kernels before wrote
        gdc_wait()
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
        if IDENTITY:
            block = b + offs_n.to(tl.int64) * 0
        else:
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

    if PDL:
        gdc_launch_dependents()
    seen = l_i > 0.0  # false for an empty part (or an empty sequence): its output is 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
    if NUM_SPLITS == 1:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:  # partial results, contiguous (B, Hq, NUM_SPLITS, D) and (B, Hq, NUM_SPLITS)
        row0 = (b * kv_group * tl.num_programs(1) + heads) * NUM_SPLITS
        rows = row0 + split
        tl.store(part_o_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], o, mask=head_ok[:, None])
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + rows, lse, mask=head_ok)
        if FUSED_MERGE:
            tl.debug_barrier()  # every thread's partial stores precede the ticket (release)
            counter = count_ptr + b * tl.num_programs(1) + h_kv
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == NUM_SPLITS - 1:  # the last part in: merge them all, a head at a
                # time, each head's parts loaded at once (one round trip, not NUM_SPLITS)
                offs_s = tl.arange(0, BLOCK_S)
                s_ok = offs_s < NUM_SPLITS
                for g in range(kv_group):
                    head = h_kv * kv_group + g
                    first = (b * kv_group * tl.num_programs(1) + head) * NUM_SPLITS
                    lse_s = tl.load(part_lse_ptr + first + offs_s, mask=s_ok,
                                    other=float("-inf"), cache_modifier=".cg")
                    top = tl.max(lse_s, 0)
                    top = tl.where(top == float("-inf"), 0.0, top)  # all parts empty: output 0
                    w = tl.math.exp2(lse_s - top)
                    po = tl.load(part_o_ptr + (first + offs_s)[:, None] * HEAD_DIM
                                 + offs_d[None, :], mask=s_ok[:, None], other=0.0,
                                 cache_modifier=".cg")
                    total = tl.sum(w, 0)
                    merged = tl.sum(po * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
                    tl.store(out_ptr + b * stride_ob + head * stride_oh + offs_d * stride_od,
                             merged.to(out_ptr.dtype.element_ty))
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next call


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


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers: graphs captured earlier still use them


def _counters(device: torch.device, n: int) -> torch.Tensor | None:
    """n int32 zeros that every fused-merge launch leaves at zero; None while capturing a CUDA
    graph if the buffer would have to grow (an allocation there belongs to the graph)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 16384), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def default_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Tokens per loop step and launch shape (not autotuned: decode shapes change every step)."""
    if interpreter.INTERPRETED:
        return {"BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    if dtype == torch.float32 and head_dim >= 128:  # 4-byte tiles: keep K and V stages in smem
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor | None, seq_lens: torch.Tensor, scale: float,
                 window: int | None, num_splits: int, *, fused_merge: bool = True,
                 config: dict | None = None) -> torch.Tensor:
    """Launch the kernel (arguments checked by the caller: layer 4's paged_decode_attention,
    layer 3's triton backend). Returns (B, Hq, D)."""
    B, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    out = torch.empty((B, Hq, D), device=q.device, dtype=q.dtype)
    max_blocks = 1 if block_tables is None else block_tables.shape[1]
    if out.numel() == 0 or max_blocks == 0 or page == 0:
        return out.zero_()
    splits = num_splits
    counters = None
    if splits > 1:
        part_o = torch.empty((B, Hq, splits, D), device=q.device, dtype=torch.float32)
        part_lse = torch.empty((B, Hq, splits), device=q.device, dtype=torch.float32)
        if fused_merge:
            counters = _counters(q.device, B * Hkv)
    else:
        part_o = part_lse = out  # unused
    tables = block_tables if block_tables is not None else seq_lens  # unused when IDENTITY
    t_strides = block_tables.stride() if block_tables is not None else (0, 0)
    group = Hq // Hkv
    cfg = config or default_config(D, q.dtype)
    _paged_decode_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, tables, seq_lens, out, part_o, part_lse,
        counters if counters is not None else seq_lens,
        float(scale) * _LOG2E, int(window or 0), group, max_blocks,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *t_strides, *out.stride(),
        HEAD_DIM=D, PAGE=page, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=cfg["BLOCK_N"], NUM_SPLITS=splits, WINDOWED=window is not None,
        IDENTITY=block_tables is None, FUSED_MERGE=counters is not None,
        BLOCK_S=triton.next_power_of_2(splits),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl_launch(q.device) if counters is not None or splits == 1 else {"PDL": False},
    )
    if splits > 1 and counters is None:
        _merge_splits_kernel[(B * Hq,)](
            part_o, part_lse, out, Hq, *out.stride(),
            HEAD_DIM=D, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
            num_warps=1 if interpreter.INTERPRETED else 2,
        )
    return out
