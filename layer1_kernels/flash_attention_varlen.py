"""FlashAttention-2 over a batch of sequences of different lengths, in ONE launch (varlen).

    flash_attention_varlen(q, k, v, out, query_start_loc, seq_lens, max_query_len,
                           block_tables=None, paged=False, scale=None, impl="auto")

The serving model keeps a step's tokens flat, vLLM style: q and out are (T, Hq, D), sequence
b's queries the rows [query_start_loc[b], query_start_loc[b+1]) (query_start_loc (B+1,)).
Its keys come from one of two places:
- paged=False (a prefill from an empty cache): k, v (T, Hkv, D) are the step's own rows,
  sequence b's keys the same rows as its queries (seq_lens[b] == its query count).
- paged=True (a chunk after a cached prefix, or a step that mixes prefills and decodes):
  k, v are the cache's blocks (num_blocks, page, Hkv, D), the step's new k, v already written;
  key j of sequence b sits in block block_tables[b, j // page], row j % page. block_tables
  None: sequence b is block b (a contiguous cache: one row of `page` slots per sequence).
Causal, aligned bottom-right per sequence: query i of sequence b (i < n_q) sees keys
j <= i + (seq_lens[b] - n_q), i.e. its own position and everything before it.

Why one launch. flash_attention_tokens takes one sequence, so a step of B sequences cost B
launches per layer from a Python loop. In the engine's big runs (128-256 prompts of 128 tokens,
2,048-token steps) the steps that admit 16 new prompts beside up to 240 decoding sequences made
~250 launches per layer, and LLM.generate on the triton backend fell to 0.31x the torch
backend's at 256 sequences (8B shape, H200) while its decode step alone was 1.43x faster: the
host's time per launch (some tens of us), not the GPU's, set the pace of those steps.
Here the grid is (B * Hq, query blocks of the longest sequence): program (b*Hq + h, m) loads
its sequence's bounds from query_start_loc / seq_lens and does nothing (no loop, no memory
touched) when its query block is past the sequence's end; the rest is flash_attention.py's
program (one BLOCK_M x D query tile, online softmax over BLOCK_N keys at a time, unmasked
blocks first, the diagonal masked, blocks past the diagonal skipped). The bottom query blocks
(the most keys) launch first. Paged keys are gathered by row (a block id per key from the
table): no padded copy of the cache, which the general path (cache.read) makes every layer.
"""
from __future__ import annotations

import math

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET on CPU)

# isort: split
import triton
import triton.language as tl

from .flash_attention import (
    _DTYPES,
    _HEAD_DIMS,
    _LOG2E,
    _check_token_major,
    _online_softmax_step,
    _pick_config,
    flash_attention_reference,
)
from .host import cdiv


@triton.jit
def _key_rows(offs_n, b, q_start, Nk, tables_ptr, stride_tb, PAGE: tl.constexpr,
              PAGED: tl.constexpr, IDENTITY: tl.constexpr):
    """(block, row) of keys offs_n of sequence b, int64; keys >= Nk get block 0 (their loads
    are masked). One return: the compiler types every return alike, constexpr branches too."""
    offs = offs_n.to(tl.int64)
    if PAGED:
        if IDENTITY:
            blk = offs * 0 + b
            row = offs
        else:
            blk = tl.load(tables_ptr + b * stride_tb + offs // PAGE, mask=offs_n < Nk,
                          other=0).to(tl.int64)
            row = offs % PAGE
    else:
        blk = offs * 0
        row = q_start + offs
    return blk, row


@triton.jit
def _fold_keys(acc, l_i, m_i, q, k_ptr, v_ptr, offs_m, lo, hi, b, q_start, Nk, causal_offset,
               qk_scale, tables_ptr, stride_tb, stride_kblk, stride_kn, stride_kd,
               stride_vblk, stride_vn, stride_vd,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
               PAGED: tl.constexpr, IDENTITY: tl.constexpr, MASKED: tl.constexpr,
               PRECISION: tl.constexpr):
    """Fold key blocks [lo, hi) into the running (acc, l, m) of one query tile (k_ptr, v_ptr:
    this kv head's base). MASKED: the ragged end and the causal diagonal."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        blk, row = _key_rows(offs_n, b, q_start, Nk, tables_ptr, stride_tb, PAGE, PAGED,
                             IDENTITY)
        k_ptrs = (k_ptr + blk[:, None] * stride_kblk + row[:, None] * stride_kn
                  + offs_d[None, :] * stride_kd)
        v_ptrs = (v_ptr + blk[:, None] * stride_vblk + row[:, None] * stride_vn
                  + offs_d[None, :] * stride_vd)
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n,
                                             Nk, causal_offset, qk_scale, MASKED, True,
                                             PRECISION)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["stride_tb"],
            do_not_specialize_on_alignment=["q_start_ptr", "seq_lens_ptr", "tables_ptr"])
def _flash_varlen_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, q_start_ptr, seq_lens_ptr, tables_ptr, qk_scale, Hq, kv_group,
    stride_qn, stride_qh, stride_qd,
    stride_kblk, stride_kn, stride_kh, stride_kd,
    stride_vblk, stride_vn, stride_vh, stride_vd,
    stride_on, stride_oh, stride_od, stride_tb,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    PAGED: tl.constexpr, IDENTITY: tl.constexpr, PRECISION: tl.constexpr,
):
    bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)  # bottom query blocks (most keys) first
    b = (bh // Hq).to(tl.int64)
    h = (bh % Hq).to(tl.int64)
    h_kv = h // kv_group
    q_start = tl.load(q_start_ptr + b).to(tl.int64)
    Nq = (tl.load(q_start_ptr + b + 1) - q_start).to(tl.int32)
    if PAGED:
        Nk = tl.load(seq_lens_ptr + b).to(tl.int32)
    else:
        Nk = Nq

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = q_start + offs_m
    q = tl.load(q_ptr + rows[:, None] * stride_qn + h * stride_qh + offs_d[None, :] * stride_qd,
                mask=offs_m[:, None] < Nq, other=0.0)
    k_base = k_ptr + h_kv * stride_kh
    v_base = v_ptr + h_kv * stride_vh

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    causal_offset = Nk - Nq
    first_row = pid_m * BLOCK_M
    # keys < all_see are visible to every row of the tile; keys >= any_see to none
    all_see = tl.minimum(tl.maximum(first_row + causal_offset + 1, 0), Nk)
    any_see = tl.minimum(tl.maximum(first_row + BLOCK_M + causal_offset, 0), Nk)
    # a query block past this sequence's end (it is shorter than the longest): no key
    # loop, and the masked loads and store below touch no memory
    any_see = tl.where(first_row < Nq, any_see, 0)
    all_see = tl.minimum(all_see, any_see)
    unmasked_end = (all_see // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _fold_keys(
        acc, l_i, m_i, q, k_base, v_base, offs_m, 0, unmasked_end, b, q_start, Nk,
        causal_offset, qk_scale, tables_ptr, stride_tb, stride_kblk, stride_kn, stride_kd,
        stride_vblk, stride_vn, stride_vd, HEAD_DIM, BLOCK_N, PAGE, PAGED, IDENTITY, False,
        PRECISION)
    acc, l_i, m_i = _fold_keys(
        acc, l_i, m_i, q, k_base, v_base, offs_m, unmasked_end, any_see, b, q_start, Nk,
        causal_offset, qk_scale, tables_ptr, stride_tb, stride_kblk, stride_kn, stride_kd,
        stride_vblk, stride_vn, stride_vd, HEAD_DIM, BLOCK_N, PAGE, PAGED, IDENTITY, True,
        PRECISION)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows that saw no key: acc is 0, output 0
    out = acc / l_i[:, None]
    o_ptrs = o_ptr + rows[:, None] * stride_on + h * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=offs_m[:, None] < Nq)


def _keys_of(b: int, k: torch.Tensor, starts: list[int], n_kv: int, paged: bool,
             tables: list[list[int]] | None) -> torch.Tensor:
    """Sequence b's n_kv keys as (n_kv, Hkv, D), gathered the simple way (the reference)."""
    if not paged:
        return k[starts[b]:starts[b] + n_kv]
    page = k.shape[1]
    blocks = [b] if tables is None else tables[b][:cdiv(n_kv, page)]
    return k[blocks].reshape(-1, *k.shape[2:])[:n_kv]


def flash_attention_varlen_reference(q, k, v, out, query_start_loc, seq_lens, *,
                                     block_tables=None, paged: bool = False,
                                     scale: float | None = None) -> torch.Tensor:
    """Sequence by sequence: gather its keys, flash_attention_reference (fp32 math), write its
    rows of out. Reads the index tensors on the host (a sync on a GPU: the reference)."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    tables = None if block_tables is None else block_tables.tolist()
    for b in range(len(starts) - 1):
        rows = slice(starts[b], starts[b + 1])
        if rows.stop == rows.start:
            continue
        kb = _keys_of(b, k, starts, lens[b], paged, tables)
        vb = _keys_of(b, v, starts, lens[b], paged, tables)
        o = flash_attention_reference(q[rows].transpose(0, 1)[None], kb.transpose(0, 1)[None],
                                      vb.transpose(0, 1)[None], causal=True, scale=scale)
        out[rows] = o[0].transpose(0, 1)
    return out


def _check(q, k, v, out, query_start_loc, seq_lens, block_tables, paged: bool) -> None:
    for name, t, dims in (("q", q, 3), ("out", out, 3), ("k", k, 4 if paged else 3),
                          ("v", v, 4 if paged else 3)):
        if t.dim() != dims:
            layout = "(num_blocks, page, H, D)" if dims == 4 else "(N, H, D)"
            raise ValueError(f"{name} must be {dims}-D {layout}; got shape {tuple(t.shape)}")
    _check_token_major(q, k, v, out)
    B = seq_lens.shape[0]
    if query_start_loc.dim() != 1 or seq_lens.dim() != 1 or query_start_loc.shape[0] != B + 1:
        raise ValueError(f"query_start_loc must be (B+1,) and seq_lens (B,); got "
                         f"{tuple(query_start_loc.shape)} and {tuple(seq_lens.shape)}")
    if block_tables is not None and (not paged or block_tables.dim() != 2
                                     or block_tables.shape[0] != B):
        raise ValueError(f"block_tables must be (B, max_blocks) with paged=True; got "
                         f"{tuple(block_tables.shape)}, paged={paged}")


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           max_query_len: int, *, block_tables: torch.Tensor | None = None,
                           paged: bool = False, scale: float | None = None,
                           impl: str = "auto") -> torch.Tensor:
    """Causal attention of B sequences of different lengths in one launch (module docstring).

    q, out (T, Hq, D) token-major, any strides (rows of a fused qkv output); k, v (T, Hkv, D)
    (paged=False: each sequence's own rows) or (num_blocks, page, Hkv, D) (paged=True, with
    block_tables (B, max_blocks) int, or None: sequence b is block b). query_start_loc (B+1,)
    and seq_lens (B,) int tensors on q's device; max_query_len: the largest query count (a
    host int: sizes the grid, no device-to-host copy). D in {16, 32, 64, 128}, Hq % Hkv == 0,
    fp16/bf16/fp32. Writes out and returns it. impl: "auto" | "triton" | "torch".
    """
    _check(q, k, v, out, query_start_loc, seq_lens, block_tables, paged)
    if not interpreter.use_triton(impl, q, "flash_attention_varlen"):
        return flash_attention_varlen_reference(q, k, v, out, query_start_loc, seq_lens,
                                                block_tables=block_tables, paged=paged,
                                                scale=scale)
    if q.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {q.dtype}: expected one of {_DTYPES}")
    D = q.shape[-1]
    if D not in _HEAD_DIMS:
        raise ValueError(f"head dim {D} unsupported by the Triton kernel: "
                         f"expected one of {_HEAD_DIMS}")
    interpreter.refuse_interpreted_bf16_dot(q.dtype)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not scale > 0:  # the running max assumes scaling keeps the order of the scores
        raise ValueError(f"scale must be positive; got {scale}")
    B, Hq, Hkv = seq_lens.shape[0], q.shape[1], k.shape[-2]
    if max_query_len < 1 or B == 0 or q.shape[0] == 0:
        return out
    cfg = _pick_config(max_query_len, D, q.dtype, True)
    grid = (B * Hq, cdiv(max_query_len, cfg["BLOCK_M"]))
    if grid[1] > 65535:
        raise ValueError(f"max_query_len {max_query_len} needs {grid[1]} query blocks; "
                         "at most 65535")
    identity = paged and block_tables is None
    if paged:
        sk, sv = k.stride(), v.stride()
    else:  # (N, H, D) rows: no block axis
        sk, sv = (0, *k.stride()), (0, *v.stride())
    # PAGE is a compile-time constant: only a block table needs it (a padded read's length
    # changes every step, and each new value would compile the kernel again)
    page = k.shape[1] if paged and not identity else 1
    tables = block_tables if block_tables is not None else seq_lens  # unread when not paged
    stride_tb = block_tables.stride(0) if block_tables is not None else 0
    _flash_varlen_kernel[grid](
        q, k, v, out, query_start_loc, seq_lens, tables, scale * _LOG2E, Hq, Hq // Hkv,
        *q.stride(), *sk, *sv, *out.stride(), stride_tb,
        HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], PAGE=page, PAGED=paged,
        IDENTITY=identity, PRECISION="ieee" if interpreter.INTERPRETED else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
