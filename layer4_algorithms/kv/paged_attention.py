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
step merges the parts of each head (inside the same launch: the program that finishes a
head's last part merges them, see layer1_kernels/paged_decode.py):
    out = sum_s 2^(lse_s - M) * o_s / sum_s 2^(lse_s - M),   M = max_s lse_s
which is exactly the softmax over the whole context. The split count is chosen on the host
from B, Hkv, the table's capacity and the SM count (never from seq_lens, which live on the
device: reading them would stall the GPU and break CUDA-graph capture): it is the most
parts a context may be cut into. Each sequence is cut on the device by its own length, into
parts of at least one loop step, only as many as its keys fill (a short context in a graph
captured for a long max_model_len runs as a few parts, not as many mostly empty ones); a
sequence that fills one part has it write the output directly: no merge.

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


# ---- host side -------------------------------------------------------------------------------
@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_num_splits(batch: int, kv_heads: int, max_context: int, device: torch.device,
                    head_dim: int = 64) -> int:
    """How many parts to cut each context into at most: layer 1's paged_decode_splits (a
    power of two putting ~4 programs on each SM, no part under its shortest, none while the
    batch alone gives 2.5 programs per SM, 1.5 for head dims over 64;
    benchmarks/sweep_paged.py, benchmarks/paged_decode_latency.py) for this device's SM
    count (1 off a GPU). Host ints only."""
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 1
    return l3.paged_decode_splits(batch, kv_heads, max_context, sms, head_dim=head_dim)
    # (kv heads packed a program by layer 1's default_heads, as paged_decode assumes)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           window: int | None = None, impl: str = "auto", *,
                           num_splits: int | None = None,
                           fused_merge: bool = True) -> torch.Tensor:
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
    (flash-decoding; default pick_num_splits). fused_merge: the last part of each head merges
    the parts in the same launch (layer 1's paged_decode); False: a second merge kernel.
    fp16/bf16/fp32, D in 16..256, power of two.
    """
    # A call like one seen before (same shapes, dtypes, devices, options) was checked then:
    # its plan is kept, so a decode step's host time is mostly the launch itself.
    key = (q.shape, k_cache.shape, v_cache.shape, block_tables.shape, seq_lens.shape, q.dtype,
           k_cache.dtype, v_cache.dtype, block_tables.dtype, seq_lens.dtype, q.device,
           k_cache.device, v_cache.device, block_tables.device, seq_lens.device, scale, window,
           impl, num_splits)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(q, k_cache, v_cache, block_tables, seq_lens, scale, window, impl, num_splits)
        if len(_PLANS) > 4096:  # bounded: a long run meets each batch size's shapes once
            _PLANS.clear()
        _PLANS[key] = plan
    if plan is _REFERENCE:
        return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                window)
    splits, config = plan
    return l3.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window,
                                 splits, fused_merge=fused_merge, config=config)


_PLANS: dict[tuple, object] = {}
_REFERENCE = object()  # plan: the torch reference


def _plan(q, k_cache, v_cache, block_tables, seq_lens, scale, window, impl, num_splits):
    """Check a call's arguments; its plan: _REFERENCE, or (split count, launch config)."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, scale, window)
    # "auto" serves every model: a head dim or dtype the kernel lacks (a tiny test model's
    # D=8) takes the reference; impl="triton" asks for the kernel and gets the error below.
    kernel_takes = q.shape[-1] in _HEAD_DIMS and q.dtype in _DTYPES
    if not l3.use_triton(impl, q, "paged_decode_attention") or (impl == "auto"
                                                                 and not kernel_takes):
        return _REFERENCE
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
    max_blocks = block_tables.shape[1]
    splits = num_splits
    if splits is None:
        splits = pick_num_splits(B, Hkv, max_blocks * page, q.device, D)
    if not 1 <= splits <= 65535:
        raise ValueError(f"num_splits must be in [1, 65535]; got {splits}")
    return splits, None  # layer 1's default_config for this split count
