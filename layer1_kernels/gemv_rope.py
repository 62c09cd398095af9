"""The decode qkv projection with RoPE and the KV-cache write in its epilogue: one launch
where gemv_rms_norm + rope_cache_write took two.

    gemv_rms_norm_rope(x, w, norm_w, eps, residual, bias, cos, sin, positions,
                       k_cache, v_cache, slots, n_q_heads, n_kv_heads, head_dim)
        -> (qkv (M, N), h (M, K) or None)

qkv = rms_norm(h = x (+ residual)) @ w^T (+ bias), N = (n_q_heads + 2 n_kv_heads) * head_dim
(q heads, then k heads, then v heads, each head_dim wide: the fused qkv layout). The q and k
heads come back rotated by their token's position, and k and v are written to k_cache /
v_cache row slots[m] (the flat (slots, kv_heads, head_dim) views rope_cache_write takes).

Why it can be fused. RoPE mixes column i of a head with column i + head_dim/2, nothing else.
So the programs here own *pairs* of output columns: program p computes BLOCK_P pairs
(i, i + half) of one or more heads, with two accumulators, and rotates them in registers once
the K loop is done. The arithmetic is the unfused kernels': the product rounded to the
activation dtype (the qkv tensor), then rope.py's fp32 rotation, rounded once; so the cache
and the returned q/k match gemv_rms_norm followed by rope_cache_write bit for bit.

    bytes ~ N * K * w_itemsize (the weights; the epilogue adds a few KB)
"""
from __future__ import annotations

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET)

# isort: split
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .gemv import (
    _act,
    _check,
    _first_tiles,
    _mac,
    _prologue,
    _unpack,
    _w_tile,
    gemv_rms_norm_reference,
    norm_prologue,
    pdl_early,
    pdl_launch,
    pre_tiles,
)
from .host import cdiv, next_pow2
from .paged_decode import _LOG2E, _decode_part
from .rope_kv_write import rope_cache_write_reference

#: (BLOCK_P pairs, BLOCK_K, warps[, stages]) per (N, K); else _default_config. The picks of
#: benchmarks/gemv_shapes_sweep.py on an H200 (graph replay with PDL, weights past L2) at
#: rank 0's qkv of Llama-3.1-8B at TP=1/2/4 and Llama-3.2-1B at TP=1/2, us per call, old
#: (2, 2048, 4) default -> pick: 8B TP=1 16.0 -> 15.4, TP=2 9.0 -> 8.4, TP=4 5.3 (kept: within
#: 1 %; 12.6 MB is too short for any tile, 66 % of a copy's rate); 1B TP=2 4.0 -> 3.8, TP=1
#: 5.0 (the H100 pick kept).
TUNED: dict[tuple[int, int], tuple[int, ...]] = {
    (6144, 4096): (2, 1024, 4), (3072, 4096): (2, 1024, 4), (1536, 4096): (2, 2048, 4),
    (3072, 2048): (2, 1024, 4), (1536, 2048): (1, 1024, 4),
}


def _default_config(k: int) -> tuple[int, int, int]:
    if interpreter.INTERPRETED:
        return 2, 16, 1
    return 2, min(2048, next_pow2(k)), 4


def config_for(n: int, k: int) -> tuple[int, ...]:
    """(BLOCK_P, BLOCK_K, warps[, stages]) a call with w (n, k) launches with (before the
    rows > 1 cut of BLOCK_K): TUNED's entry for the shape, else _default_config."""
    return TUNED.get((n, k)) or _default_config(k)


@triton.jit
def _gemv_rope_kernel(x_ptr, r_ptr, h_ptr, nw_ptr, w_ptr, b_ptr, y_ptr,
                      cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,
                      M, stride_xm, stride_rm, stride_wn, stride_ym, table_stride,
                      kc_stride_s, kc_stride_h, vc_stride_s, vc_stride_h, eps,
                      K: tl.constexpr, N_PAIRS: tl.constexpr, HALF: tl.constexpr,
                      HEAD_D: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr,
                      PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, STATS_K: tl.constexpr,
                      STAGES: tl.constexpr, PDL: tl.constexpr, PDL_EARLY: tl.constexpr,
                      PRE_TILES: tl.constexpr,
                      # the attention tail (ATTEND; see gemv_rms_norm_rope_attention)
                      o_ptr, cnt_ptr, lens_ptr, kb_ptr, vb_ptr, tables_ptr, qk_scale, max_keys,
                      stride_tb, stride_tc, kb_stride_blk, kb_stride_tok, kb_stride_h,
                      vb_stride_blk, vb_stride_tok, vb_stride_h,
                      ATTEND: tl.constexpr, PAGE: tl.constexpr, IDENTITY: tl.constexpr,
                      BLOCK_G: tl.constexpr, ATT_BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    OUT_TY: tl.constexpr = y_ptr.dtype.element_ty
    TWO: tl.constexpr = PRE_TILES > 1 and K > BLOCK_K  # second K tiles requested up front
    j = pid * BLOCK_P + tl.arange(0, BLOCK_P)  # pair index over all heads
    j_ok = j < N_PAIRS
    head = j // HALF
    i = j % HALF  # the pair's first column inside its head
    n_lo = head * HEAD_D + i
    n_hi = n_lo + HALF
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    offs_k = tl.arange(0, BLOCK_K)
    lo_rows = w_ptr + n_lo.to(tl.int64)[:, None] * stride_wn
    hi_rows = w_ptr + n_hi.to(tl.int64)[:, None] * stride_wn

    # weights first (they do not depend on the kernel before), as in gemv._gemv_kernel
    w_lo = _w_tile(lo_rows, offs_k, j_ok, K, EVEN_K)
    w_hi = _w_tile(hi_rows, offs_k, j_ok, K, EVEN_K)
    # (PRE_TILES 2, as in gemv._gemv_kernel)
    w_lo1 = _w_tile(lo_rows, BLOCK_K + offs_k, j_ok, K, EVEN_K) if TWO else None
    w_hi1 = _w_tile(hi_rows, BLOCK_K + offs_k, j_ok, K, EVEN_K) if TWO else None
    # ... and the epilogue's positions, slots and cos/sin (no kernel of the step writes them:
    # loaded here, they arrive during the K loop instead of adding two round trips after it)
    mask = m_ok[:, None] & j_ok[None, :]
    pos = tl.load(pos_ptr + m, mask=m_ok, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + m, mask=m_ok, other=0).to(tl.int64)[:, None]
    tab = pos[:, None] * table_stride + i[None, :]
    c = tl.load(cos_ptr + tab, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + tab, mask=mask, other=0.0).to(tl.float32)
    rstd = _prologue(x_ptr, r_ptr, h_ptr, nw_ptr, stride_xm, stride_rm, m, m_ok, eps, K,
                     PROLOGUE, HAS_RESIDUAL, BLOCK_M, STATS_K, OUT_TY, PDL, PDL_EARLY)

    if BLOCK_M == 1:
        acc_lo = tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.float32)
    else:
        acc_lo = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)  # (the late norm's sums of squares)
    acc_lo, acc_hi, ss = _first_tiles(acc_lo, acc_hi, w_lo, w_hi, w_lo1, w_hi1, x_ptr, r_ptr,
                                      h_ptr, nw_ptr, stride_xm, stride_rm, m, m_ok, offs_k,
                                      rstd, ss, K, PROLOGUE, HAS_RESIDUAL, pid == 0, OUT_TY,
                                      EVEN_K, BLOCK_K, BLOCK_M, TWO)
    for k0 in tl.range(BLOCK_K * (2 if TWO else 1), K, BLOCK_K, num_stages=STAGES):  # as in
        # _gemv_kernel
        k = k0 + offs_k
        w_lo = _w_tile(lo_rows, k, j_ok, K, EVEN_K)
        w_hi = _w_tile(hi_rows, k, j_ok, K, EVEN_K)
        a, ss = _act(x_ptr, r_ptr, h_ptr, nw_ptr, stride_xm, stride_rm, m, m_ok, k, rstd, ss,
                     K, PROLOGUE, HAS_RESIDUAL, pid == 0, OUT_TY, EVEN_K)
        acc_lo = _mac(acc_lo, w_lo, a, BLOCK_M)
        acc_hi = _mac(acc_hi, w_hi, a, BLOCK_M)
    if PDL and not PDL_EARLY:
        gdc_launch_dependents()
    if BLOCK_M == 1:
        lo = tl.sum(acc_lo, 1)[None, :]
        hi = tl.sum(acc_hi, 1)[None, :]
    else:
        lo = acc_lo
        hi = acc_hi
    if PROLOGUE == 3:  # the late norm (gemv.set_norm_late): each row's 1 / rms
        rstd = 1.0 / tl.sqrt(ss / K + eps)
        lo = lo * rstd[:, None]
        hi = hi * rstd[:, None]
    if HAS_BIAS:
        lo += tl.load(b_ptr + n_lo, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        hi += tl.load(b_ptr + n_hi, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    # the qkv row as the unfused GEMV stores it, then rope.py's fp32 rotation of q and k heads
    lo = lo.to(OUT_TY).to(tl.float32)
    hi = hi.to(OUT_TY).to(tl.float32)
    rot = (head < NQ + NKV)[None, :]
    o_lo = tl.where(rot, lo * c - hi * s, lo).to(OUT_TY)
    o_hi = tl.where(rot, hi * c + lo * s, hi).to(OUT_TY)
    y_row = y_ptr + m[:, None] * stride_ym
    tl.store(y_row + n_lo[None, :], o_lo, mask=mask)
    tl.store(y_row + n_hi[None, :], o_hi, mask=mask)
    # k heads to k_cache, v heads to v_cache, at the token's slot
    is_k = ((head >= NQ) & (head < NQ + NKV))[None, :]
    kdst = kc_ptr + slot * kc_stride_s + (head - NQ)[None, :] * kc_stride_h + i[None, :]
    tl.store(kdst, o_lo, mask=mask & is_k)
    tl.store(kdst + HALF, o_hi, mask=mask & is_k)
    is_v = (head >= NQ + NKV)[None, :]
    vdst = vc_ptr + slot * vc_stride_s + (head - NQ - NKV)[None, :] * vc_stride_h + i[None, :]
    tl.store(vdst, o_lo, mask=mask & is_v)
    tl.store(vdst + HALF, o_hi, mask=mask & is_v)
    if ATTEND:
        _group_attention(pid, M, y_ptr, stride_ym, o_ptr, cnt_ptr, lens_ptr, kb_ptr, vb_ptr,
                         tables_ptr, qk_scale, max_keys, stride_tb, stride_tc, kb_stride_blk,
                         kb_stride_tok, kb_stride_h, vb_stride_blk, vb_stride_tok, vb_stride_h,
                         HALF, HEAD_D, NQ, NKV, BLOCK_P, PAGE, IDENTITY, BLOCK_G, ATT_BLOCK_N)


@triton.jit
def _group_attention(pid, M, y_ptr, stride_ym, o_ptr, cnt_ptr, lens_ptr, kb_ptr, vb_ptr,
                     tables_ptr, qk_scale, max_keys, stride_tb, stride_tc, kb_stride_blk,
                     kb_stride_tok, kb_stride_h, vb_stride_blk, vb_stride_tok, vb_stride_h,
                     HALF: tl.constexpr, HEAD_D: tl.constexpr, NQ: tl.constexpr,
                     NKV: tl.constexpr, BLOCK_P: tl.constexpr, PAGE: tl.constexpr,
                     IDENTITY: tl.constexpr, BLOCK_G: tl.constexpr, ATT_BLOCK_N: tl.constexpr):
    """Decode attention of this program's kv group (its G query heads, its k and v head),
    run by whichever of the group's (G + 2) * HALF / BLOCK_P programs finishes last: each
    takes a ticket from the group's counter once its q / k / v columns and cache rows are
    stored (after a barrier, acquire-release: the last one sees every other's stores), and
    the last reads the group's rotated q from the qkv row and its keys and values, the new
    ones included, from the cache (paged_decode's loop, one part per sequence), writes o,
    and resets the counter for the next call."""
    G: tl.constexpr = NQ // NKV
    head0 = (pid * BLOCK_P) // HALF  # (HALF % BLOCK_P == 0: one head a program)
    if head0 < NQ:
        grp = head0 // G
    elif head0 < NQ + NKV:
        grp = head0 - NQ
    else:
        grp = head0 - NQ - NKV
    tl.debug_barrier()  # every thread's stores precede the ticket (release)
    ticket = tl.atomic_add(cnt_ptr + grp, 1, sem="acq_rel", scope="gpu")
    if ticket == (G + 2) * (HALF // BLOCK_P) - 1:
        for row in range(M):
            b = tl.cast(row, tl.int64)
            hi = tl.load(lens_ptr + b).to(tl.int32)
            hi = tl.maximum(tl.minimum(hi, max_keys), 0)  # never read past the table
            offs_n0 = tl.arange(0, ATT_BLOCK_N)
            table = tables_ptr + b * stride_tb
            if IDENTITY:  # contiguous cache: sequence b's rows are block b
                block0 = b + offs_n0.to(tl.int64) * 0
            else:
                block0 = tl.load(table + (offs_n0 // PAGE) * stride_tc, mask=offs_n0 < hi,
                                 other=0).to(tl.int64)
            # one part [0, hi): the output itself, no partials (o_ptr stands in for them)
            _decode_part(y_ptr, kb_ptr, vb_ptr, table, o_ptr, o_ptr, o_ptr, cnt_ptr, qk_scale,
                         b, grp, 0, 0, hi, hi, block0, G, NKV, 1, 1,
                         stride_ym, HEAD_D, 1, kb_stride_blk, kb_stride_tok, kb_stride_h, 1,
                         vb_stride_blk, vb_stride_tok, vb_stride_h, 1, stride_tc,
                         NQ * HEAD_D, HEAD_D, 1, HEAD_DIM=HEAD_D, PAGE=PAGE, BLOCK_G=BLOCK_G,
                         BLOCK_N=ATT_BLOCK_N, IDENTITY=IDENTITY, FUSED_MERGE=False, PDL=False,
                         MERGE_G=2, MERGE_S=2, EARLY_INDEX=False, EARLY_KV=False, HEADS=1,
                         PEEL=False, TRIGGER_EARLY=False, PIPELINED_IDS=False)
        tl.atomic_xchg(cnt_ptr + grp, 0, sem="relaxed", scope="gpu")  # ready for the next call


def gemv_rms_norm_rope_reference(x, w, norm_weight, eps, residual, bias, cos, sin, positions,
                                 k_cache, v_cache, slots, n_q_heads, n_kv_heads, head_dim):
    """The unfused ops: gemv_rms_norm's reference, then rope_cache_write's on its views."""
    y, h = gemv_rms_norm_reference(x, w, norm_weight, eps, residual, bias)
    q, k, v = _heads(y, n_q_heads, n_kv_heads, head_dim)
    rope_cache_write_reference(q, k, v, cos, sin, positions, k_cache, v_cache, slots)
    return y, h


def _heads(y, n_q, n_kv, d):
    T = y.shape[0]
    q, k, v = y.split([n_q * d, n_kv * d, n_kv * d], dim=-1)
    return q.view(T, n_q, d), k.view(T, n_kv, d), v.view(T, n_kv, d)


def gemv_rms_norm_rope(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None, bias: torch.Tensor | None,
                       cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                       n_q_heads: int, n_kv_heads: int, head_dim: int, *, impl: str = "auto",
                       config: tuple[int, int, int] | None = None,
                       trigger_early: bool | None = None):
    """rms_norm(h = x (+ residual)) @ w^T (+ bias) with RoPE on its q/k heads and k, v written
    to the cache rows `slots` -> (qkv (M, N), h or None). config: (BLOCK_P, BLOCK_K, warps).
    trigger_early: under PDL let the next kernel launch right after the first weight tile is
    requested (None: set_decode_pdl's rule), e.g. a decode attention that requests its older
    keys and values before its own wait (paged_decode's early_kv)."""
    return _rope("gemv_rms_norm_rope", x, w, norm_weight, eps, residual, bias, cos, sin,
                 positions, k_cache, v_cache, slots, n_q_heads, n_kv_heads, head_dim, impl,
                 config, None, trigger_early)


def gemv_rms_norm_rope_attention(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor,
                                 eps: float, residual: torch.Tensor | None,
                                 bias: torch.Tensor | None, cos: torch.Tensor,
                                 sin: torch.Tensor, positions: torch.Tensor,
                                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 slots: torch.Tensor, n_q_heads: int, n_kv_heads: int,
                                 head_dim: int, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                                 block_tables: torch.Tensor | None, seq_lens: torch.Tensor,
                                 scale: float, *, impl: str = "auto",
                                 config: tuple[int, int, int] | None = None):
    """gemv_rms_norm_rope, then decode attention of each row's rotated q over its sequence's
    keys and values (the new ones just written included) in the same launch ->
    (qkv (M, N), h or None, o (M, n_q_heads, head_dim)).

    k_blocks, v_blocks (blocks, page, n_kv_heads, head_dim): the cache that k_cache / v_cache
    (its flat slot views) write, as paged_decode reads it; block_tables (M, max_blocks), or
    None for a contiguous cache (row m is block m); seq_lens (M,): keys [0, seq_lens[m]) of
    row m are visible (no sliding window). Calls on one device run one after another (the
    groups' counters are shared, as paged_decode's are)."""
    return _rope("gemv_rms_norm_rope_attention", x, w, norm_weight, eps, residual, bias, cos,
                 sin, positions, k_cache, v_cache, slots, n_q_heads, n_kv_heads, head_dim, impl,
                 config, (k_blocks, v_blocks, block_tables, seq_lens, scale))


#: keys a loop step of the attention tail takes (a program of the qkv GEMV's warps runs it)
ATTENTION_BLOCK_N = 32
#: (BLOCK_P, BLOCK_K, warps[, stages]) of the launch with the attention tail, per (N, K); else
#: _attention_config. A kernel's registers are the most any part of it needs, and the tail's
#: tiles (16 query rows x ATTENTION_BLOCK_N keys x D) need more than the GEMV: fewer, wider
#: programs keep the GEMV in one wave. ptxas (sm_90, Llama-3.2-1B's qkv, bf16): the plain pick
#: (2, 1024, 4) takes 80 registers (6 programs an SM, 768 programs); with the tail 113 (4 an
#: SM: 1.5 waves), 162 at 64 keys a step; (4, 1024, 8) with the tail 80 (3 an SM: its 384
#: programs in one wave). Not yet timed on a GPU.
ATTENTION_TUNED: dict[tuple[int, int], tuple[int, ...]] = {(3072, 2048): (4, 1024, 8)}


def _attention_config(n: int, k: int) -> tuple[int, ...]:
    if interpreter.INTERPRETED:
        return _default_config(k)
    return ATTENTION_TUNED.get((n, k)) or (4, min(1024, next_pow2(k)), 8)
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """n int32 zeros that every attention-tail launch leaves at zero (one per kv group), kept
    per device; a larger buffer replaces a smaller one (while a CUDA graph is captured the new
    one is the graph's own: its replays then zero it themselves)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 64), dtype=torch.int32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _COUNTERS[device] = buf
    return buf


def _check_caches(name, x, caches, lead: tuple[str, ...], n_kv_heads, head_dim) -> None:
    """Each (what, tensor) of caches must be (*lead, n_kv_heads, head_dim) in x's dtype, on
    x's device, with a contiguous last dim: the kernel's k/v cache check, shared by the
    contiguous caches it writes (lead: slots) and the paged ones its attention tail reads
    (lead: blocks, page)."""
    for what, c in caches:
        if (c.dim() != len(lead) + 2 or c.shape[len(lead):] != (n_kv_heads, head_dim)
                or c.dtype != x.dtype or c.stride(-1) != 1 or c.device != x.device):
            raise ValueError(f"{name}: {what} must be ({', '.join(lead)}, {n_kv_heads}, "
                             f"{head_dim}) {x.dtype} on {x.device}, contiguous last dim; got "
                             f"{tuple(c.shape)} {c.dtype} on {c.device}")


def _check_attention(name, x, attention, n_q_heads, n_kv_heads, head_dim) -> None:
    kb, vb, tables, lens, scale = attention
    M = x.shape[0]
    if n_q_heads % n_kv_heads:
        raise ValueError(f"{name}: n_q_heads {n_q_heads} must be a multiple of n_kv_heads "
                         f"{n_kv_heads}")
    if head_dim < 16 or head_dim & (head_dim - 1):  # (paged_decode's tiles: tensor-core dots)
        raise ValueError(f"{name}: head_dim must be a power of two >= 16, got {head_dim}")
    _check_caches(name, x, (("k_blocks", kb), ("v_blocks", vb)), ("blocks", "page"),
                  n_kv_heads, head_dim)
    if tables is None and kb.shape[0] < M:
        raise ValueError(f"{name}: a contiguous cache (block_tables None) needs a block per "
                         f"row: {kb.shape[0]} blocks for {M} rows")
    if tables is not None and (tables.dim() != 2 or tables.shape[0] != M
                               or tables.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"{name}: block_tables must be int ({M}, max_blocks), got "
                         f"{tables.dtype} {tuple(tables.shape)}")
    if lens.shape != (M,) or lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: seq_lens must be int32/int64 ({M},), got {lens.dtype} "
                         f"{tuple(lens.shape)}")


def group_attention_reference(q, k_blocks, v_blocks, block_tables, seq_lens, scale):
    """Decode attention in fp32, a row at a time: q (M, Hq, D) over keys [0, seq_lens[m]) of
    sequence m, read through its block table (None: block m) -> (M, Hq, D) in q's dtype."""
    M, Hq, D = q.shape
    page, Hkv = k_blocks.shape[1], k_blocks.shape[2]
    out = torch.zeros_like(q)
    for m in range(M):
        n = int(seq_lens[m])
        pos = torch.arange(n, device=q.device)
        blocks = (torch.full_like(pos, m) if block_tables is None
                  else block_tables[m].long()[pos // page])
        k = k_blocks[blocks, pos % page].float()  # (n, Hkv, D)
        v = v_blocks[blocks, pos % page].float()
        kv_head = torch.arange(Hq, device=q.device) // (Hq // Hkv)
        s = torch.einsum("hd,nhd->hn", q[m].float(), k[:, kv_head]) * scale
        out[m] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v[:, kv_head]).to(q.dtype)
    return out


def _rope(name, x, w, norm_weight, eps, residual, bias, cos, sin, positions, k_cache, v_cache,
          slots, n_q_heads, n_kv_heads, head_dim, impl, config, attention, trigger_early=None):
    """gemv_rms_norm_rope's checks and launch; attention: (k_blocks, v_blocks, block_tables,
    seq_lens, scale) for the attention tail (see gemv_rms_norm_rope_attention), or None."""
    M, K = x.shape if x.dim() == 2 else (-1, -1)
    _check(name, x, w, bias, K)
    N = (n_q_heads + 2 * n_kv_heads) * head_dim
    if n_q_heads < 1 or n_kv_heads < 1 or head_dim < 2 or head_dim % 2 or w.shape[0] != N:
        raise ValueError(f"{name}: w {tuple(w.shape)} must have (n_q_heads "
                         f"{n_q_heads} + 2 * n_kv_heads {n_kv_heads}) * head_dim {head_dim} "
                         "rows, head_dim even")
    if norm_weight.shape != (K,) or norm_weight.device != x.device:
        raise ValueError(f"{name}: norm_weight must be ({K},) on {x.device}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device or residual.stride(-1) != 1):
        raise ValueError(f"{name}: residual must match x (shape, dtype, device, "
                         "contiguous last dim)")
    half = head_dim // 2
    if cos.dim() != 2 or cos.shape[1] != half or sin.shape != cos.shape:
        raise ValueError(f"{name}: cos and sin must be (max_pos, {half}), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    for what, t in (("positions", positions), ("slots", slots)):
        if t.shape != (M,) or t.dtype not in (torch.int32, torch.int64) or t.device != x.device:
            raise ValueError(f"{name}: {what} must be int32/int64 ({M},) on "
                             f"{x.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    _check_caches(name, x, (("k_cache", k_cache), ("v_cache", v_cache)), ("slots",),
                  n_kv_heads, head_dim)
    if config is not None:
        try:
            _unpack(config)
        except ValueError:
            raise ValueError(f"{name}: config (BLOCK_P, BLOCK_K, warps[, stages]) "
                             f"must be three powers of two and a stage count, got {config}"
                             ) from None
    if attention is not None:
        _check_attention(name, x, attention, n_q_heads, n_kv_heads, head_dim)
    if not interpreter.use_triton(impl, x, name):
        y, h = gemv_rms_norm_rope_reference(x, w, norm_weight, eps, residual, bias, cos, sin,
                                            positions, k_cache, v_cache, slots, n_q_heads,
                                            n_kv_heads, head_dim)
        if attention is None:
            return y, h
        q = y[:, :n_q_heads * head_dim].view(M, n_q_heads, head_dim)
        return y, h, group_attention_reference(q, *attention)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    h = torch.empty_like(x) if residual is not None else None
    block_p, block_k, warps, stages = _unpack(
        config or (config_for(N, K) if attention is None else _attention_config(N, K)))
    block_m = next_pow2(M)
    if block_m > 1:  # the 3D product tiles (two of them): keep them within the registers
        block_k = min(block_k, max(16, 2048 // (block_m * block_p)))
    r = residual if residual is not None else x
    cos_c, sin_c = cos.contiguous(), sin.contiguous()
    if attention is None:  # (the tail's arguments unused: any tensor, zeros)
        o, tail = None, (y, y, y, y, y, y, 0.0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        consts = dict(ATTEND=False, PAGE=1, IDENTITY=True, BLOCK_G=16, ATT_BLOCK_N=16)
    else:
        while half % block_p:  # one head a program: its group's ticket is well defined
            block_p //= 2
        kb, vb, tables, lens, scale = attention
        o = torch.empty((M, n_q_heads, head_dim), dtype=x.dtype, device=x.device)
        identity = tables is None
        tail = (o, _counters(x.device, n_kv_heads), lens, kb, vb, lens if identity else tables,
                float(scale) * _LOG2E, kb.shape[1] * (1 if identity else tables.shape[1]),
                *((0, 0) if identity else tables.stride()), kb.stride(0), kb.stride(1),
                kb.stride(2), vb.stride(0), vb.stride(1), vb.stride(2))
        consts = dict(ATTEND=True, PAGE=kb.shape[1], IDENTITY=identity,
                      BLOCK_G=max(16, next_pow2(n_q_heads // n_kv_heads)),
                      ATT_BLOCK_N=16 if interpreter.INTERPRETED else ATTENTION_BLOCK_N)
    _gemv_rope_kernel[(cdiv(N // 2, block_p),)](
        x, r, x if h is None else h, norm_weight.contiguous(), w,
        x if bias is None else bias, y, cos_c, sin_c, positions, slots, k_cache, v_cache,
        M, x.stride(0), r.stride(0), w.stride(0), y.stride(0), cos_c.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), float(eps),
        K=K, N_PAIRS=N // 2, HALF=half, HEAD_D=head_dim, NQ=n_q_heads, NKV=n_kv_heads,
        PROLOGUE=norm_prologue(), HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_K=block_k, EVEN_K=K % block_k == 0,
        STATS_K=max(16, min(next_pow2(K), 8192 // block_m)), STAGES=stages, num_warps=warps,
        PDL_EARLY=(pdl_early(w.numel() * w.element_size(), rope=True) if trigger_early is None
                   else bool(trigger_early)), PRE_TILES=pre_tiles(),
        **pdl_launch(x.device), **dict(zip(_TAIL_ARGS, tail, strict=True)), **consts,
    )
    return (y, h) if o is None else (y, h, o)


_TAIL_ARGS = ("o_ptr", "cnt_ptr", "lens_ptr", "kb_ptr", "vb_ptr", "tables_ptr", "qk_scale",
              "max_keys", "stride_tb", "stride_tc", "kb_stride_blk", "kb_stride_tok",
              "kb_stride_h", "vb_stride_blk", "vb_stride_tok", "vb_stride_h")
