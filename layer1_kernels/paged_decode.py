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

The parts. The split count is the launch's (fixed when a CUDA graph is captured, from the
table's capacity: a graph for max_model_len 8k launches 64 parts at batch 1); the lengths
are on the device. So each sequence is cut by its own length: parts of at least min_part
keys (whole BLOCK_N steps), only as many as its keys fill; the programs past them return at
once, and a sequence that fills one part (a short context) has it write the output itself:
no partials, no ticket, no merge. (Without the fused merge every part writes a partial: the
merge kernel reads them all.)

The merge. With more than one part, each program writes its partial result, then takes a
ticket from a per-(sequence, kv head) counter (an atomic add, acquire-release, after a
barrier so every thread's stores come first); the program that draws the last ticket reads
all parts of its G heads back at once (a (G, MERGE_S, D) tile per round trip, 16 parts by
default: a larger tile costs the whole kernel registers, see _tiles) and writes the
lse-weighted mean, then resets the counter to 0 for the next call. That saves the second launch
flash-decoding usually needs (~2-3 us each on a GPU, x layers per token). The counters and
the partial results live in buffers kept per device (the counters zero between calls); when
one must grow while a CUDA graph is being captured, the partials get a fresh tensor of the
graph's and the merge a separate kernel. Calls on one device must therefore run one after
another (one stream, or graphs replayed in turn), as a model's layers do.

Under programmatic dependent launch (PDL: the kernel may start while the one before it
drains) a program reads its sequence's length and first block ids before it waits for that
kernel (EARLY_INDEX): lengths and block tables are a step's inputs, which no kernel of the
step writes (a PDL kernel right before this one must not write them). The loop fetches each
next tile's block ids a step ahead, so a tile's K/V loads wait on one round trip, not two.

Block ids and the software pipeline. With num_stages > 1 Triton's compiler pipelines the
loop: it copies the keys and values of tiles ahead into shared memory (cp.async) while the
current one is computed. But a tile's addresses need its block ids, and ids fetched a step
ahead in registers (above) are a load the pipeline does not see as one: it issues that load
right before the copies that need it, and waits for it, a round trip every step (at 1 x 16k,
four steps a program, these add up to most of a microsecond). With PIPELINED_IDS the loop
loads each tile's own ids instead, and the pipeline sees the chain ids -> keys: from
num_stages 5 on (the compiler spreads the stages over the two loads) it copies the ids two
steps before the keys and values, and those two steps before their math, all asynchronous.
(With fewer stages it keeps the keys one step ahead and waits on every copy each step.)

The launch. At small shapes the host costs more than the kernel (a decode step at batch 1
moves ~2 MB per layer: ~2 us on an H100), so a call does little besides the launch: the
split count is a runtime argument (one compiled kernel serves every count), and after the
first call of a shape the compiled kernel is launched directly (`_LAUNCHES`, keyed by what
Triton specializes on), skipping the JIT's per-call argument binding and cache lookup.
"""
from __future__ import annotations

import functools

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET)

# isort: split
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .gemv import pdl_launch
from .host import next_pow2

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["window", "max_blocks", "num_splits", "min_part", "stride_tb"],
            do_not_specialize_on_alignment=["tables_ptr", "seq_lens_ptr"])  # gathers, not rows
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr, count_ptr,
    qk_scale, window, kv_group, num_kv_heads, max_blocks, num_splits, min_part,
    stride_qb, stride_qh, stride_qd,
    stride_kblk, stride_ktok, stride_kh, stride_kd,
    stride_vblk, stride_vtok, stride_vh, stride_vd,
    stride_tb, stride_tc, stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr, IDENTITY: tl.constexpr, FUSED_MERGE: tl.constexpr,
    PDL: tl.constexpr, MERGE_G: tl.constexpr, MERGE_S: tl.constexpr, HEADS_FIRST: tl.constexpr,
    EARLY_INDEX: tl.constexpr, HEADS: tl.constexpr, PEEL: tl.constexpr,
    TRIGGER_EARLY: tl.constexpr, PIPELINED_IDS: tl.constexpr,
):
    if PDL and TRIGGER_EARLY:  # the next kernel may launch now: see TRIGGER_EARLY below
        gdc_launch_dependents()
    if PDL and not EARLY_INDEX:  # everything below reads what the kernels before wrote
        gdc_wait()
    if HEADS_FIRST:  # neighbouring programs: the kv heads of one sequence (same cache rows)
        grp = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1).to(tl.int64)
    else:
        b = tl.program_id(0).to(tl.int64)
        grp = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    # This sequence's visible keys [lo, hi) and this program's part of them [start, end).
    hi = tl.load(seq_lens_ptr + b).to(tl.int32)
    hi = tl.maximum(tl.minimum(hi, max_blocks * PAGE), 0)  # never read past the table
    lo = hi * 0
    if WINDOWED:
        lo = tl.maximum(hi - window, 0)
    part = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
    if FUSED_MERGE:  # parts of at least min_part keys, only as many as the keys fill (>= 1)
        part = tl.maximum(part, min_part)
        n_parts = tl.maximum(tl.cdiv(hi - lo, part), 1)
    else:  # the merge kernel reads every part: each writes one (an empty one: lse -inf)
        n_parts = num_splits + split * 0
    start = lo + split * part
    end = tl.minimum(start + part, hi)
    if split < n_parts:  # (a program past the last part with keys does nothing)
        table = tables_ptr + b * stride_tb
        if HEADS == 1:
            offs_n0 = start + tl.arange(0, BLOCK_N)
        else:  # a tile's column c: token c // HEADS (see _decode_part)
            offs_n0 = start + tl.arange(0, HEADS * BLOCK_N) // HEADS
        if IDENTITY or (PIPELINED_IDS and not PEEL):  # (none needed here)
            block0 = b + offs_n0.to(tl.int64) * 0
        else:  # the first tile's block ids (the loop fetches each next tile's a step ahead)
            block0 = tl.load(table + (offs_n0 // PAGE) * stride_tc, mask=offs_n0 < end,
                             other=0).to(tl.int64)
        _decode_part(q_ptr, k_ptr, v_ptr, table, out_ptr, part_o_ptr, part_lse_ptr, count_ptr,
                     qk_scale, b, grp, split, start, end, block0, kv_group, num_kv_heads,
                     num_splits, n_parts, stride_qb, stride_qh, stride_qd, stride_kblk,
                     stride_ktok, stride_kh, stride_kd, stride_vblk, stride_vtok, stride_vh,
                     stride_vd, stride_tc, stride_ob, stride_oh, stride_od, HEAD_DIM, PAGE,
                     BLOCK_G, BLOCK_N, IDENTITY, FUSED_MERGE, PDL, MERGE_G, MERGE_S,
                     EARLY_INDEX, HEADS, PEEL, TRIGGER_EARLY, PIPELINED_IDS)


@triton.jit
def _attend(q, k, v, valid, m_i, l_i, acc, qk_scale):
    """One online-softmax step over a (BLOCK_N, D) tile of keys and values (scores where
    `valid` -- (1, BLOCK_N) or (BLOCK_G, BLOCK_N) -- is false masked): the new (running max,
    sum, accumulator). A row with no valid key before any (an empty part, a padding row)
    keeps sum and accumulator 0."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # (BLOCK_G, BLOCK_N) fp32
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    top = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - top[:, None])
    alpha = tl.math.exp2(m_i - top)  # rescales what was summed under the old max
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _decode_part(q_ptr, k_ptr, v_ptr, table, out_ptr, part_o_ptr, part_lse_ptr, count_ptr,
                 qk_scale, b, grp, split, start, end, block0, kv_group, num_kv_heads,
                 num_splits, n_parts, stride_qb, stride_qh, stride_qd, stride_kblk, stride_ktok,
                 stride_kh, stride_kd, stride_vblk, stride_vtok, stride_vh, stride_vd, stride_tc,
                 stride_ob, stride_oh, stride_od,
                 HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK_N: tl.constexpr, IDENTITY: tl.constexpr, FUSED_MERGE: tl.constexpr,
                 PDL: tl.constexpr, MERGE_G: tl.constexpr, MERGE_S: tl.constexpr,
                 EARLY_INDEX: tl.constexpr, HEADS: tl.constexpr, PEEL: tl.constexpr,
                 TRIGGER_EARLY: tl.constexpr, PIPELINED_IDS: tl.constexpr):
    """One program's part [start, end) of the keys of kv heads grp * HEADS .. + HEADS - 1 for
    sequence b (block0: its first tile's block ids): online softmax over BLOCK_N keys a step;
    the output itself when the part is the only one, else its partial result (and with the
    fused merge, the last part in merges them all). Under PDL with EARLY_INDEX: wait for the
    kernel before here (PEEL: the first tile peeled off the loop, as this kernel was; one kv
    head a program only). PIPELINED_IDS: each loop step loads its own tile's block ids, for
    the compiler's software pipeline to fetch ahead (see the module docstring), instead of
    the next tile's a step ahead in registers.

    HEADS > 1 (kv heads packed in one program): the rows are the G * HEADS query heads of
    the HEADS kv heads (16 rows hold 4 groups of 4 where one group pads 12), and a tile's
    HEADS * BLOCK_N columns are (token, kv head) pairs, head fastest: column c is token
    c // HEADS of kv head c % HEADS, so a token's HEADS head rows -- adjacent in the cache --
    come in one contiguous run (512 bytes at 4 heads of D 64, not 128). Query row r scores
    only its own kv head's columns (c % HEADS == r // G; the other scores are masked to -inf
    and their probabilities are 0 in P @ V): the tensor-core work per byte is the same as
    one head's padded 16-row tile."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_c = tl.arange(0, HEADS * BLOCK_N)
    h_kv0 = grp * HEADS  # this program's first kv head
    heads = h_kv0 * kv_group + offs_g
    if HEADS == 1:
        head_ok = offs_g < kv_group
        col_tok = offs_c
        col_head = h_kv0
        n_kv = 1
    else:
        row_kv = offs_g // kv_group  # each row's kv head, counted from h_kv0
        head_ok = (row_kv < HEADS) & (h_kv0 + row_kv < num_kv_heads)
        col_tok = offs_c // HEADS
        col_head = h_kv0 + offs_c % HEADS
        same_head = (offs_c % HEADS)[None, :] == row_kv[:, None]
        n_kv = tl.minimum(num_kv_heads - h_kv0, HEADS)

    # The query heads of this program's kv heads: one (BLOCK_G, D) tile, padding rows masked.
    q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32)
    block_next = block0
    first = start
    if PEEL:  # the first tile peeled. Token n -> (its block, its row) -> its k, v rows.
        offs_n = start + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        row = offs_n % PAGE
        k_ptrs = (k_ptr + block0 * stride_kblk + row * stride_ktok + h_kv0 * stride_kh)[:, None] \
            + offs_d[None, :] * stride_kd
        v_ptrs = (v_ptr + block0 * stride_vblk + row * stride_vtok + h_kv0 * stride_vh)[:, None] \
            + offs_d[None, :] * stride_vd
        if PDL and EARLY_INDEX:
            gdc_wait()
        k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
        if not IDENTITY and not PIPELINED_IDS:
            nxt = offs_n + BLOCK_N
            block_next = tl.load(table + (nxt // PAGE) * stride_tc, mask=nxt < end,
                                 other=0).to(tl.int64)
        q = tl.load(q_ptrs, mask=head_ok[:, None], other=0.0)
        m_i, l_i, acc = _attend(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale)
        first = start + BLOCK_N
    else:  # every tile in the loop: its loads go through the software pipeline (num_stages),
        # and no tile is held in registers outside it
        if PDL and EARLY_INDEX:
            gdc_wait()
        q = tl.load(q_ptrs, mask=head_ok[:, None], other=0.0)

    for n0 in range(first, end, BLOCK_N):
        # Token n -> (its block, its row in the block) -> its k, v rows; the next tile's
        # block ids are fetched a step ahead, so a tile's loads wait on one round trip.
        offs_n = n0 + col_tok
        valid = offs_n < end
        if HEADS > 1:
            valid = valid & (col_head < num_kv_heads)
        if PIPELINED_IDS and not IDENTITY:  # this tile's own ids: the pipeline fetches them
            block = tl.load(table + (offs_n // PAGE) * stride_tc, mask=valid,
                            other=0).to(tl.int64)
        else:
            block = block_next
            if not IDENTITY:
                nxt = offs_n + BLOCK_N
                block_next = tl.load(table + (nxt // PAGE) * stride_tc, mask=nxt < end,
                                     other=0).to(tl.int64)
        row = offs_n % PAGE
        k_rows = k_ptr + block * stride_kblk + row * stride_ktok + col_head * stride_kh
        v_rows = v_ptr + block * stride_vblk + row * stride_vtok + col_head * stride_vh
        k = tl.load(k_rows[:, None] + offs_d[None, :] * stride_kd, mask=valid[:, None], other=0.0)
        v = tl.load(v_rows[:, None] + offs_d[None, :] * stride_vd, mask=valid[:, None], other=0.0)
        if HEADS == 1:
            m_i, l_i, acc = _attend(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale)
        else:
            m_i, l_i, acc = _attend(q, k, v, valid[None, :] & same_head, m_i, l_i, acc,
                                    qk_scale)

    if PDL and not TRIGGER_EARLY:
        gdc_launch_dependents()
    seen = l_i > 0.0  # false for an empty part (or an empty sequence): its output is 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    if n_parts == 1:
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:  # partial results, contiguous (B, Hq, num_splits, D) and (B, Hq, num_splits)
        head0 = (b * num_kv_heads + h_kv0) * kv_group  # this program's first query head
        rows = (head0 + offs_g) * num_splits + split
        tl.store(part_o_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], o, mask=head_ok[:, None])
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + rows, lse, mask=head_ok)
        if FUSED_MERGE:
            tl.debug_barrier()  # every thread's partial stores precede the ticket (release)
            counter = count_ptr + b * tl.cdiv(num_kv_heads, HEADS) + grp
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == n_parts - 1:  # the last part in: merge them all
                _merge_parts(part_o_ptr, part_lse_ptr, out_ptr, head0, kv_group * n_kv,
                             num_splits, n_parts, b * stride_ob + h_kv0 * kv_group * stride_oh,
                             stride_oh, stride_od, HEAD_DIM, MERGE_G, MERGE_S)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next call


@triton.jit
def _merge_parts(part_o_ptr, part_lse_ptr, out_ptr, head0, n_heads, num_splits, n_parts,
                 out_offset, stride_oh, stride_od,
                 HEAD_DIM: tl.constexpr, MERGE_G: tl.constexpr, MERGE_S: tl.constexpr):
    """out[head0 + g] = the lse-weighted mean of its first n_parts partial results (a head's
    rows num_splits apart), for the n_heads heads from head0 at once: (MERGE_G, MERGE_S, D)
    parts a round trip, combined with a running max (as the softmax itself), so no second
    pass over the lse values."""
    offs_g = tl.arange(0, MERGE_G)
    offs_s = tl.arange(0, MERGE_S)
    offs_d = tl.arange(0, HEAD_DIM)
    g_ok = offs_g < n_heads
    first = (head0 + offs_g) * num_splits  # (MERGE_G,) each head's part 0
    m = tl.full((MERGE_G,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((MERGE_G,), dtype=tl.float32)
    acc = tl.zeros((MERGE_G, HEAD_DIM), dtype=tl.float32)
    for s0 in range(0, n_parts, MERGE_S):
        ok = g_ok[:, None] & ((s0 + offs_s) < n_parts)[None, :]
        rows = first[:, None] + s0 + offs_s[None, :]  # (MERGE_G, MERGE_S)
        lse = tl.load(part_lse_ptr + rows, mask=ok, other=float("-inf"), cache_modifier=".cg")
        po = tl.load(part_o_ptr + rows[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                     mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 1))
        top = tl.where(m_new == float("-inf"), 0.0, m_new)  # no part seen a key yet: weights 0
        alpha = tl.math.exp2(m - top)
        w = tl.math.exp2(lse - top[:, None])
        total = total * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(po * w[:, :, None], 1)
        m = m_new
    merged = acc / tl.where(total > 0.0, total, 1.0)[:, None]  # every part empty: output 0
    tl.store(out_ptr + out_offset + offs_g[:, None] * stride_oh + offs_d[None, :] * stride_od,
             merged.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


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


# ---- per-device buffers ------------------------------------------------------------------------
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_PARTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers: graphs captured earlier still use them


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _counters(device: torch.device, n: int) -> torch.Tensor | None:
    """n int32 zeros that every fused-merge launch leaves at zero; None while capturing a CUDA
    graph if the buffer would have to grow (an allocation there belongs to the graph)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if _capturing(device):
            return None
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 16384), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def _parts(device: torch.device, rows: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 room for `rows` partial results (o: rows x head_dim, lse: rows), kept per device
    (allocating them each call costs the host more than a small call's kernel). While a graph
    is being captured and the kept ones are too small: fresh ones, the graph's own."""
    need = max(rows * head_dim, 1)
    kept = _PARTS.get(device)
    if kept is not None and kept[0].numel() >= need and kept[1].numel() >= rows:
        return kept
    if _capturing(device):
        return (torch.empty(need, dtype=torch.float32, device=device),
                torch.empty(max(rows, 1), dtype=torch.float32, device=device))
    if kept is not None:
        _RETIRED.extend(kept)
    size = max(need, 1 << 16)
    kept = (torch.empty(size, dtype=torch.float32, device=device),
            torch.empty(max(size // head_dim, rows, 1), dtype=torch.float32, device=device))
    _PARTS[device] = kept
    return kept


# ---- configs ----------------------------------------------------------------------------------
# The split rule from benchmarks/sweep_paged.py on an H100 (Hq 32, Hkv 8, D 64, bf16, pages
# of 16; CUDA-graph replay): batch 1-32 x contexts 1k-16k and a batch-256 engine-like step.
# The shortest part and the configs from benchmarks/paged_decode_latency.py on an H200 (the
# 8B shape at TP=1 and per rank at TP=4, D 128, and the 1B shape, D 64; batch 1 and 32,
# contexts 128-4096; graph replay, keys from DRAM, also after a PDL GEMV as in a step).
#: programs per SM a split count aims for: the best split count put 256-1024 programs on the
#: 132 SMs (batch 1-8: 512; batch 4 x 4k: 1024). Four is also how many of the default D-64
#: launch fit on an SM at once while the merge tile is 16 parts (118 registers a thread).
PROGRAMS_PER_SM = 4
#: ... but a D-64 split count over 16 merges 32 parts a round trip (153 registers: 3 programs
#: an SM), so it aims at one wave of those: batch 1 gets 32 parts, not 64 (H200, graph
#: replay, 1 x 16k: 13.4 us, 64 parts with a 16-part merge 13.6, with a 32-part merge in 1.3
#: waves 16.5; 1 x 4k: 64 parts, 16-part merge 7.8 us, 32-part 6.7)
PROGRAMS_PER_SM_WIDE_MERGE = 3
#: no split from this many programs per SM on. Batch 32 x 8 kv heads (1.94 an SM) splits in
#: two past UNSPLIT_UP_TO keys: on an H200 two parts ran 2-4 % faster than one at 16k
#: (256.1 vs 260.8 us) and the old default, unsplit with 2 stages, 15-30 % slower at
#: 1k-16k; on the H100 one part had been 2-3 % faster. Batch 8: 0.48, eight parts 1.5-15 %
#: faster than four.
SPLIT_BELOW = 2.5
#: ... and up to this many keys it stays unsplit, with 3 pipeline stages (default_config):
#: batch 32 x 1k 21.8 us vs 22.7 in two parts (0.88x SDPA vs 0.84x), x 4k 70.7 vs 70.9
UNSPLIT_UP_TO = 4096
#: ... for head dims over 64: D 128's unsplit launch (8 warps, 121 registers) fits 2 programs
#: an SM, so batch 32's 256 programs already fill the GPU in one wave (two parts: two waves)
SPLIT_BELOW_WIDE = 1.5
#: the shortest part, in keys (the kernel rounds a part up to whole BLOCK_N steps, so with the
#: default configs the shortest part is one loop step: 64 keys at D 128, 128 at D 64). At
#: batch 1 on the H200, 16 was best or within 1 % of the best of 16-256 at every shape: parts
#: of one step beat longer ones at short contexts (8B, context 256: 5.0 vs 6.8 us a call at
#: 128), and at long ones the program count bounds the split count anyway.
MIN_SPLIT_TOKENS = 16
MAX_SPLITS = 64


#: kv heads one program reads together by default (1: none packed; see _decode_part), from
#: PACK_FROM (sequence, kv head) pairs an SM on, head dims <= 64 only
PACK_HEADS = 1
PACK_FROM = 1.0


def default_heads(batch: int, kv_heads: int, head_dim: int, sm_count: int) -> int:
    """How many kv heads a program reads by default (config "heads"): PACK_HEADS where the
    batch alone gives PACK_FROM programs an SM (D <= 64), else 1."""
    if PACK_HEADS <= 1 or head_dim > 64 or batch * kv_heads < PACK_FROM * sm_count:
        return 1
    return min(PACK_HEADS, next_pow2(kv_heads))


def paged_decode_splits(batch: int, kv_heads: int, max_context: int, sm_count: int,
                        min_part: int | None = None, head_dim: int = 64,
                        heads: int | None = None) -> int:
    """How many parts to cut each context into at most (host ints only: the lengths stay on
    the device; the kernel cuts a shorter context into fewer parts, none under min_part keys,
    default MIN_SPLIT_TOKENS). A power of two, so that parts are whole multiples of the
    kernel's BLOCK_N: a count of 6 at 1k keys cuts parts of 171, rounded up to 256: four
    parts, not six. heads: kv heads a program (None: default_heads)."""
    min_part = MIN_SPLIT_TOKENS if min_part is None else min_part
    if heads is None:
        heads = default_heads(batch, kv_heads, head_dim, sm_count)
    programs = batch * -(-kv_heads // max(1, heads))
    if programs >= (SPLIT_BELOW if head_dim <= 64 else SPLIT_BELOW_WIDE) * sm_count:
        return 1
    if head_dim <= 64 and programs >= SPLIT_BELOW_WIDE * sm_count \
            and max_context <= UNSPLIT_UP_TO:
        return 1  # (the batch-32 regime at short contexts: one long part, 3 stages)
    wanted = min(PROGRAMS_PER_SM * sm_count // max(programs, 1), max_context // max(min_part, 1),
                 MAX_SPLITS)
    if head_dim <= 64 and wanted >= 2 * MERGE_PARTS_NARROW:  # a 32-part merge tile
        wanted = min(wanted, PROGRAMS_PER_SM_WIDE_MERGE * sm_count // max(programs, 1))
    return 1 << (wanted.bit_length() - 1) if wanted > 1 else 1


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sms(dev: torch.device) -> int:
    """The device's SM count (1 off a GPU: the split rule's "one SM")."""
    return 1 if dev.type != "cuda" else _sm_count(
        dev.index if dev.index is not None else torch.cuda.current_device())


def default_min_part() -> int:
    """The shortest part (keys) the kernel cuts a context into: MIN_SPLIT_TOKENS, the split
    rule's. Interpreted: one 16-key step (the CPU tests cut short contexts into many parts)."""
    return 16 if interpreter.INTERPRETED else MIN_SPLIT_TOKENS


#: D 128 parts up to this many keys take the latency-bound split config (below)
SHORT_PART = 1024


def default_config(head_dim: int, dtype: torch.dtype, splits: int = 1,
                   max_context: int | None = None, heads: int = 1,
                   few_programs: bool = False, per_sm: float | None = None) -> dict:
    """Tokens per loop step, launch shape and shortest part (not autotuned: decode shapes
    change every step). 16-bit (H200, graph replay, per call, vs the best of 7-9 configs x 5
    shortest parts at each shape):
    D 64: 128 keys a step, 4 warps, 2 stages, split or not (1B: batch 1 within 2 % at contexts
    128, 1k and 4k, 16 % at 256; batch 32 the best); unsplit with few_programs (fewer than
    SPLIT_BELOW an SM: batch 32's regime) FEW_PROGRAM_STAGES stages;
    D 128 split into short parts (max_context / splits <= SHORT_PART keys; max_context None:
    any split): 64 keys, 4 warps, no pipelining (latency-bound; 8B batch 1 at TP=1 and per
    rank at TP=4: within 0-8 %, 3 % on average), each part's first block ids read before the
    PDL wait, not in the loop (H100, batch 1 and 4, 8B per rank at TP=1/2/4, contexts
    128-2048, graph replay: 0.89-0.93x the time alone, 0.97-0.99x after a PDL GEMV per TP=4
    rank; benchmarks/decode_attention_tiles.py's old_ahead);
    D 128 unsplit or long parts: 128 keys, 8 warps, 2 stages (long loops: bandwidth-bound; 8B
    batch 32: 0.88x the time of 64 keys with 4 warps at context 4096, 0.91x at 1k, 0.97-1.03x
    at 128-256).
    heads > 1 (kv heads packed, D <= 64 16-bit): tiles of 128 (token, head) rows, 4 warps,
    2 stages, the merge reading 16 / heads parts a round trip (4 heads: 127 registers a
    thread, 4 programs an SM).
    D 64 with long parts in one wave (PIPELINED_IDS on; per_sm: a paged launch's programs an
    SM (None: not paged, or not counted), at most PIPELINED_PROGRAMS_PER_SM; parts of
    max_context / splits >= PIPELINED_MIN_PART keys): 128 keys, 4 warps, PIPELINED_STAGES
    stages, each step's block ids in the software pipeline; at most 2 programs an SM with
    parts of PIPELINED_MIN_PART keys (batch 1 x 16k): 7 stages, a part's four tiles nearly
    all in flight at once (106 KB of shared memory: 2 programs an SM)."""
    part = {"min_part": default_min_part()}
    if interpreter.INTERPRETED:
        return {"BLOCK_N": 16, "num_warps": 1, "num_stages": 1, **part,
                **({"heads": heads} if heads > 1 else {})}
    if heads > 1 and head_dim <= 64 and dtype != torch.float32:
        return {"BLOCK_N": max(16, 128 // heads), "num_warps": 4, "num_stages": 2,
                "heads": heads, "merge_s": max(2, 16 // heads), **part}
    if dtype == torch.float32 and head_dim >= 128:  # 4-byte tiles: keep K and V stages in smem
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, **part}
    if dtype != torch.float32 and head_dim == 128:
        if splits > 1 and (max_context is None or max_context // splits <= SHORT_PART):
            return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 1, "pipelined_ids": False,
                    **part}
        return {"BLOCK_N": 128, "num_warps": 8, "num_stages": 2, **part}
    if dtype == torch.float32 or head_dim > 64:  # not swept: the previous default
        return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, **part}
    part_keys = max_context // max(splits, 1) if max_context is not None else 0
    if PIPELINED_IDS["on"] and per_sm is not None and per_sm <= PIPELINED_PROGRAMS_PER_SM \
            and part_keys >= PIPELINED_MIN_PART:  # see PIPELINED_IDS
        short = per_sm <= 2 and part_keys <= PIPELINED_MIN_PART
        return {"BLOCK_N": 128, "num_warps": 4, "pipelined_ids": True,
                "num_stages": PIPELINED_SHORT_STAGES if short else PIPELINED_STAGES, **part}
    if splits == 1 and few_programs:
        return {"BLOCK_N": 128, "num_warps": 4, "num_stages": FEW_PROGRAM_STAGES, **part}
    return {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2, **part}


#: stages of an unsplit D-64 launch with fewer than SPLIT_BELOW programs an SM (more tiles in
#: flight per program where there are few programs)
FEW_PROGRAM_STAGES = 3
#: parts a merge round trip reads at most (per head; config "merge_s" overrides): 32 where
#: the split count is over MERGE_PARTS_NARROW, else 16 (the tile sets the registers, so the
#: programs an SM: see _tiles; the split rule keeps a 32-part launch to one wave)
MERGE_PARTS = 32
MERGE_PARTS_NARROW = 16


@functools.cache
def _tiles(group: int, head_dim: int, splits: int, merge_parts: int = MERGE_PARTS,
           heads: int = 1) -> tuple[int, int, int]:
    """(BLOCK_G, MERGE_G, MERGE_S): the G query heads of a program's `heads` kv heads padded
    to 16 rows (the smallest tensor-core tile); for the merge all of them (padded to a power
    of two) and 16 parts a round trip, or up to merge_parts where the split count is over 16,
    within 8192 floats. The merge tile sets the kernel's registers, so how many programs fit
    on an SM: ptxas (sm_90, BLOCK_N 128, 4 warps, 2 stages, D 64, G 4) gives 96 / 118 / 153
    registers a thread at 8 / 16 / 32 parts: 5 / 4 / 3 programs an SM (unfused: 122). So a
    32-part launch aims at 3 programs an SM (paged_decode_splits): a batch-1 x 16k launch of
    64 parts x 8 kv heads would take 1.3 waves; of 32, one, merged in one round trip."""
    g = max(2, next_pow2(group * heads))
    return max(16, next_pow2(group * heads)), g, max(2, min(max(16, next_pow2(splits)),
                                                next_pow2(merge_parts), 8192 // (g * head_dim)))


# ---- launch ------------------------------------------------------------------------------------
#: Under PDL, read the lengths and block tables (and the first block ids) before waiting for
#: the kernel before: they are the step's inputs, never written by the decode kernels.
EARLY_INDEX = {"on": True}
#: Let the next kernel launch when this one starts instead of after its key loop. At batch 1
#: the launch is a few dozen programs, latency-bound, with most SM slots idle: the next
#: kernel (the o_proj GEMV) fills them and requests its weight tiles -- at Llama-3.2-1B's
#: o_proj tile, the whole matrix -- while attention runs, then waits for its output
#: (griddepcontrol.wait: until this grid has finished and its writes are visible). Safe for
#: the same reason as the GEMVs' early trigger: no kernel of the step reads, before its own
#: wait, anything the kernel before it writes.
TRIGGER_EARLY = {"on": False}
#: Peel the first tile off the loop (as the kernel did before every tile went through the
#: loop's pipeline; kept to time the two against each other: benchmarks/sweep_paged.py)
PEEL_FIRST = {"on": False}
#: Each loop step loads its own tile's block ids for the software pipeline to fetch ahead
#: (config "pipelined_ids"; see the module docstring): with num_stages 5 or more only. By
#: default (default_config) where it won on an H200 (graph replay, sweep_paged.py --defaults
#: --flip-pipelined): D 64 launches whose parts are PIPELINED_MIN_PART keys or more and
#: whose programs fit in one wave at PIPELINED_PROGRAMS_PER_SM an SM: 1 x 16k (32 parts)
#: 13.4 -> 12.8 us, 32 x 1k 21.8 -> 20.9, 32 x 4k 70.2 -> 66.7 (unsplit); the same in a
#: second run, and with three caches in turn (each call's K/V from DRAM, as a model's layers
#: read theirs) 1 x 16k 17.4 -> 14.9 us (SDPA 14.3). Elsewhere (one run) it lost:
#: parts of one step (1 x 4k: 6.5 -> 7.2 us; the ids then come after the PDL wait, through
#: shared memory) and launches of 512 programs, one wave at 4 an SM but 1.3 at 3 (4 x 16k
#: 39.0 -> 48.4, 32 x 16k 257 -> 327).
PIPELINED_IDS = {"on": True}
#: the stages of such a launch: the fewest at which the compiler copies the keys and values
#: two steps ahead (it spreads the stages over the two loads: ids, then keys and values)
PIPELINED_STAGES = 5
#: ... which hold 72 KB of shared memory a program (D 64, 128 keys): 3 programs an SM
PIPELINED_PROGRAMS_PER_SM = 3
#: ... and are worth it from parts of four loop steps
PIPELINED_MIN_PART = 512
#: stages where parts are that short and the launch fits one wave at 2 programs an SM: three
#: tiles copied ahead (H200, graph replay, 1 x 16k in 32 parts: 11.7 us at 7 stages, 12.9 at 5,
#: 13.2 with the ids a step ahead; SDPA 11.0. At 32 x 16k unsplit, 128 steps a part, 7 stages
#: ran 258.5 us against 5 stages' 248.5: long loops want the third program an SM)
PIPELINED_SHORT_STAGES = 7

#: (shape, strides, dtypes, config, flags) -> the compiled kernel that served it. Everything
#: Triton specializes the kernel on is in the key (pointer alignment: only 16-byte aligned
#: q and caches take this path), so a hit may launch the kernel directly.
_LAUNCHES: dict[tuple, object] = {}
_DIRECT = {"on": True}  # False: every call through the JIT (the sweep compares the two)


def _hooked() -> bool:
    """True when launch hooks are set (a profiler's): the JIT path calls them. Triton 3.6
    keeps them as HookChains, empty unless something added a hook; earlier ones as None."""
    r = triton.knobs.runtime
    return any(h is not None and getattr(h, "calls", True)
               for h in (r.launch_enter_hook, r.launch_exit_hook))


@functools.cache
def _stream_getter():
    from triton.runtime import driver
    return driver.active.get_current_stream, driver.active.get_current_device


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor | None, seq_lens: torch.Tensor, scale: float,
                 window: int | None, num_splits: int | None = None, *,
                 fused_merge: bool = True, config: dict | None = None,
                 heads_first: bool = True) -> torch.Tensor:
    """Launch the kernel (arguments checked by the caller: layer 4's paged_decode_attention,
    layer 3's triton backend). Returns (B, Hq, D). num_splits None: paged_decode_splits from
    the table's capacity; config None: default_config. heads_first: neighbouring programs
    are a sequence's kv heads, which read the same cache rows (a token's heads are adjacent)
    at about the same time: never slower in the sweep, 2-4 % faster where K/V come from DRAM
    (batch 8-256); batch-major where B > 65535 (the grid's second axis holds the batch).
    config keys beyond the launch's (BLOCK_N, num_warps, num_stages): min_part, merge_s
    (parts a merge round trip), heads (kv heads one program reads together, a power of two:
    see _decode_part; default_heads: 1 while PACK_HEADS is 1), early_index, peel (see
    PEEL_FIRST), trigger_early (see TRIGGER_EARLY), pipelined_ids (see PIPELINED_IDS)."""
    B, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    dev = q.device
    out = torch.empty((B, Hq, D), device=dev, dtype=q.dtype)
    max_blocks = 1 if block_tables is None else block_tables.shape[1]
    if B == 0 or Hq == 0 or max_blocks == 0 or page == 0:
        return out.zero_()
    min_part = (config or {}).get("min_part") or default_min_part()
    explicit = bool(config and "BLOCK_N" in config)
    heads = int((config or {}).get("heads") or 0)
    if not heads:  # (PACK_HEADS 1: no SM count needed, the launch path stays short)
        heads = 1 if explicit or PACK_HEADS <= 1 else default_heads(B, Hkv, D, _sms(dev))
    splits = num_splits
    if splits is None:
        splits = paged_decode_splits(B, Hkv, max_blocks * page, _sms(dev), min_part, D, heads)
    group = Hq // Hkv
    part_o, part_lse = _parts(dev, B * Hq * splits if splits > 1 else 0, D)
    # (one split takes them too, unused: the same compiled kernel serves every split count)
    counters = _counters(dev, B * Hkv) if fused_merge else None  # (a counter per program's
    # kv heads: B * Hkv is enough for any packing)
    fused = counters is not None
    if not explicit:
        few = splits == 1 and B * -(-Hkv // heads) < SPLIT_BELOW * _sms(dev)
        per_sm = B * -(-Hkv // heads) * splits / _sms(dev) \
            if PIPELINED_IDS["on"] and block_tables is not None else None
        # (a contiguous cache has no ids to pipeline: it keeps its config)
        cfg = {**default_config(D, q.dtype, splits, max_blocks * page, heads, few, per_sm),
               **(config or {})}
    else:
        cfg = config
    pdl = pdl_launch(dev) if fused or splits == 1 else {"PDL": False}
    early = bool(pdl["PDL"] and cfg.get("early_index", EARLY_INDEX["on"]))
    heads = max(1, min(next_pow2(int(cfg.get("heads") or 1)), next_pow2(Hkv)))
    peel = bool(cfg.get("peel", PEEL_FIRST["on"])) and heads == 1
    trigger_early = bool(pdl["PDL"] and cfg.get("trigger_early", TRIGGER_EARLY["on"]))
    identity = block_tables is None
    pipelined_ids = bool(cfg.get("pipelined_ids", PIPELINED_IDS["on"])) and not identity
    heads_first = heads_first and B <= 65535
    groups = -(-Hkv // heads)  # programs per (sequence, part)
    grid = (groups, B, splits) if heads_first else (B, groups, splits)
    tables = seq_lens if identity else block_tables  # unused when IDENTITY
    t_stride_b, t_stride_c = (0, 0) if identity else block_tables.stride()
    block_g, merge_g, merge_s = _tiles(group, D, splits, cfg.get("merge_s") or MERGE_PARTS,
                                       heads)
    args = (q, k_cache, v_cache, tables, seq_lens, out, part_o, part_lse,
            counters if fused else seq_lens,
            float(scale) * _LOG2E, min(int(window or 0), 2**31 - 1), group, Hkv, max_blocks, splits,
            max(1, int(min_part)), *q.stride(), *k_cache.stride(), *v_cache.stride(),
            t_stride_b, t_stride_c,
            *out.stride(),
            D, page, block_g, cfg["BLOCK_N"],
            window is not None, identity, fused, pdl["PDL"], merge_g, merge_s, heads_first, early,
            heads, peel, trigger_early, pipelined_ids)
    key = None
    if _DIRECT["on"] and not interpreter.INTERPRETED:
        # (out and the buffers are ours: aligned; tables and seq_lens: not specialized on)
        if (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) & 15 == 0:
            key = (dev, q.dtype, tables.dtype, seq_lens.dtype, q.shape, q.stride(),
                   k_cache.shape, k_cache.stride(), v_cache.stride(), t_stride_c, group,
                   window is not None, identity, fused, pdl["PDL"], heads_first, early,
                   cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"], merge_s, heads, peel,
                   trigger_early, pipelined_ids)
    kernel = _LAUNCHES.get(key) if key is not None and not _hooked() else None
    if kernel is not None:
        get_stream, get_device = _stream_getter()
        try:  # the launcher parses its arguments before launching: a failure launched nothing
            kernel.run(grid[0], grid[1], grid[2], get_stream(get_device()), kernel.function,
                       kernel.packed_metadata, None, None, None, *args)
        except (TypeError, ValueError, SystemError):  # a Triton whose launcher differs
            _DIRECT["on"] = False
            kernel = None
    if kernel is None:
        kernel = _paged_decode_kernel[grid](*args, num_warps=cfg["num_warps"],
                                            num_stages=cfg["num_stages"],
                                            **({"launch_pdl": True} if pdl["PDL"] else {}))
        if key is not None and kernel is not None and hasattr(kernel, "packed_metadata"):
            _LAUNCHES[key] = kernel
    if splits > 1 and not fused:
        _merge_splits_kernel[(B * Hq,)](
            part_o, part_lse, out, Hq, *out.stride(),
            HEAD_DIM=D, NUM_SPLITS=splits, BLOCK_S=next_pow2(splits),
            num_warps=1 if interpreter.INTERPRETED else 2,
        )
    return out
