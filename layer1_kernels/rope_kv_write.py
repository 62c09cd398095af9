"""RoPE on q and k fused with the KV-cache write: one launch per decode layer instead of three
(rope, then a scatter each for k and v).

    rope_cache_write(q, k, v, cos, sin, positions, k_cache, v_cache, slots)

q (T, Hq, D), k and v (T, Hkv, D) (strided views of a fused qkv row are fine: the last dim
must be contiguous); cos, sin (max_pos, D/2) as in rope.py; positions and slots (T,) int;
k_cache and v_cache (num_slots, Hkv, D), the flat slot view of one layer's cache (layer 3's
contiguous cache and layer 4's paged cache both store token t at row slots[t] of it).
q and k are rotated in place (rope.py's rotate_half convention and fp32 arithmetic), and
rotated k and v are written to their slots: afterwards the cache holds what
`apply_rope` followed by `index_copy_` would have left there, bit for bit.

One program per token: it reads the token's position, slot and cos/sin row once and uses
them for every head of q and k. Slots are not range-checked (that would sync the host);
they come from the cache's own context.

    bytes = tokens * ((2 Hq + 3 Hkv + 2 Hkv) * D) * itemsize + tokens * D * table_itemsize
"""
from __future__ import annotations

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET)

# isort: split
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .gemv import pdl_launch
from .host import next_pow2
from .rope import _check as _check_rope
from .rope import _rotate_heads, rope_reference


@triton.jit
def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,
                       q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                       kc_stride_s, kc_stride_h, vc_stride_s, vc_stride_h, table_stride,
                       n_q_heads, n_k_heads,
                       HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    # positions, slots and the tables are not written by the kernel before (the qkv GEMV):
    # under PDL they are read before waiting for it.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HALF
    cos = tl.load(cos_ptr + pos * table_stride + d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * table_stride + d, mask=d_mask, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    _rotate_heads(q_ptr + t * q_stride_t, q_stride_h, n_q_heads, cos, sin, d, d_mask, HALF,
                  BLOCK_HQ)
    # k: rotate, store in place and into its slot; v: copy into its slot.
    h = tl.arange(0, BLOCK_HK)
    mask = (h[:, None] < n_k_heads) & d_mask[None, :]
    src = k_ptr + t * k_stride_t + h[:, None] * k_stride_h + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    c, s = cos[None, :], sin[None, :]
    o1 = (x1 * c - x2 * s).to(k_ptr.dtype.element_ty)
    o2 = (x2 * c + x1 * s).to(k_ptr.dtype.element_ty)
    tl.store(src, o1, mask=mask)
    tl.store(src + HALF, o2, mask=mask)
    dst = kc_ptr + slot * kc_stride_s + h[:, None] * kc_stride_h + d[None, :]
    tl.store(dst, o1, mask=mask)
    tl.store(dst + HALF, o2, mask=mask)
    vsrc = v_ptr + t * v_stride_t + h[:, None] * v_stride_h + d[None, :]
    vdst = vc_ptr + slot * vc_stride_s + h[:, None] * vc_stride_h + d[None, :]
    tl.store(vdst, tl.load(vsrc, mask=mask), mask=mask)
    tl.store(vdst + HALF, tl.load(vsrc + HALF, mask=mask), mask=mask)


def rope_cache_write_reference(q, k, v, cos, sin, positions, k_cache, v_cache, slots):
    """apply_rope's reference, copied back into q and k, then index_copy_ of k and v."""
    q_out, k_out = rope_reference(q, k, cos, sin, positions)
    q.copy_(q_out)
    k.copy_(k_out)
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)
    return q, k


def rope_cache_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slots: torch.Tensor, *,
                     impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place by their positions, write k and v to k_cache/v_cache rows
    `slots`; returns (q, k). impl: "auto" | "triton" | "torch" as for apply_rope."""
    positions = _check_rope(q, k, cos, sin, positions)
    T, Hkv, D = k.shape
    if v.shape != k.shape or v.dtype != k.dtype or v.stride(-1) != 1:
        raise ValueError(f"v must match k {tuple(k.shape)} {k.dtype} with a contiguous last "
                         f"dim, got {tuple(v.shape)} {v.dtype}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 3 or c.shape[1:] != (Hkv, D) or c.dtype != k.dtype or c.stride(-1) != 1:
            raise ValueError(f"{name} must be (slots, {Hkv}, {D}) {k.dtype} with a contiguous "
                             f"last dim, got {tuple(c.shape)} {c.dtype}")
        if c.device != q.device:
            raise ValueError(f"{name} is on {c.device} but q is on {q.device}")
    if slots.shape != (T,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be int32/int64 of shape ({T},), got {slots.dtype} "
                         f"{tuple(slots.shape)}")
    if not interpreter.use_triton(impl, q, "rope_cache_write"):
        return rope_cache_write_reference(q, k, v, cos, sin, positions, k_cache, v_cache, slots)
    if T == 0:
        return q, k
    half = D // 2
    cos_c, sin_c = cos.contiguous(), sin.contiguous()
    _rope_cache_kernel[(T,)](
        q, k, v, cos_c, sin_c, positions.contiguous(), slots.contiguous(), k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        cos_c.stride(0), q.shape[1], Hkv,
        HALF=half, BLOCK_D=next_pow2(half),  # plain-Python pow2: host time (host.py)
        BLOCK_HQ=next_pow2(max(q.shape[1], 1)),
        BLOCK_HK=next_pow2(max(Hkv, 1)), num_warps=4, **pdl_launch(q.device),
    )
    return q, k
