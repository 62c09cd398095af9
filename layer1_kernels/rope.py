"""Rotary position embedding (RoPE) applied to q and k in place, in one kernel.

Llama / HF "rotate_half" (non-interleaved) convention: each head vector of size D is split
into halves x1 = x[:D/2] and x2 = x[D/2:], and pair i (x1[i], x2[i]) is rotated by the
angle pos * base**(-2i/D):

    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin

which is HF's apply_rotary_pos_emb, q * cat(cos, cos) + rotate_half(q) * cat(sin, sin),
with rotate_half(x) = cat(-x2, x1).

Shapes: q (tokens, n_heads, D), k (tokens, n_kv_heads, D), D even; cos, sin (max_pos, D/2)
tables from `rope_cache`; positions (tokens,) int32/int64, default arange(tokens). q and k
may be strided views (e.g. slices of a fused qkv projection) as long as the last dim is
contiguous; they are overwritten and returned.

The kernel: one program per token. It loads the token's position, then one row of the cos
and sin tables (D/2 values each), then all of q's heads as two (heads, D/2) tiles (x1, x2),
rotates them in fp32 and stores them back, then does the same for k. The table row is read
once per token and reused by every head of q and k, and q and k share one launch; eager
torch gathers cos/sin, builds cat/rotate_half temporaries and multiplies in several passes.

    FLOPs = 3 * tokens * (n_heads + n_kv_heads) * D          (4 mul + 2 add per pair)
    bytes = 2 * tokens * (n_heads + n_kv_heads) * D * itemsize      (read and write q, k)
            + tokens * D * table_itemsize + tokens * pos_itemsize   (cos/sin rows, positions)
"""
from __future__ import annotations

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET)

# isort: split
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotate_heads(x_ptr, stride_h, n_heads, cos, sin, d, d_mask,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate all heads of one token (x_ptr points at its head 0) in place."""
    h = tl.arange(0, BLOCK_H)
    p1 = x_ptr + h[:, None] * stride_h + d[None, :]  # (BLOCK_H, BLOCK_D) first halves
    mask = (h[:, None] < n_heads) & d_mask[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    tl.store(p1, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr,
                 q_stride_t, q_stride_h, k_stride_t, k_stride_h, table_stride,
                 n_q_heads, n_k_heads,
                 HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HALF  # D/2 need not be a power of two (e.g. D = 80, 96)
    cos = tl.load(cos_ptr + pos * table_stride + d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * table_stride + d, mask=d_mask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + t * q_stride_t, q_stride_h, n_q_heads, cos, sin, d, d_mask, HALF, BLOCK_HQ
    )
    _rotate_heads(
        k_ptr + t * k_stride_t, k_stride_h, n_k_heads, cos, sin, d, d_mask, HALF, BLOCK_HK
    )


def rope_cache(
    max_pos: int, head_dim: int, base: float = 10000.0, *,
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables, each (max_pos, head_dim // 2): angle[p, i] = p * base**(-2i/head_dim).

    Computed in fp32 exactly as HF's LlamaRotaryEmbedding does (so tables match HF's first
    half, which HF duplicates with cat(freqs, freqs)), then cast to `dtype`.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    if max_pos < 0:
        raise ValueError(f"max_pos must be >= 0, got {max_pos}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (base ** exponents)
    angles = torch.outer(torch.arange(max_pos, device=device, dtype=torch.float32), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's apply_rotary_pos_emb in eager torch (fp32 math), out of place: new (q, k)."""
    if positions is None:
        positions = torch.arange(q.shape[0], device=q.device)
    # Gather each token's row and duplicate it to full width, as HF's rotary module does.
    c = torch.cat((cos[positions], cos[positions]), dim=-1).float()[:, None, :]  # (T, 1, D)
    s = torch.cat((sin[positions], sin[positions]), dim=-1).float()[:, None, :]
    qf, kf = q.float(), k.float()
    q_out = qf * c + _rotate_half(qf) * s
    k_out = kf * c + _rotate_half(kf) * s
    return q_out.to(q.dtype), k_out.to(k.dtype)


def _check(q, k, cos, sin, positions) -> torch.Tensor:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be (tokens, heads, head_dim), got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    tokens, _, head_dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} must have q's tokens and head_dim {tuple(q.shape)}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype:
        raise ValueError(f"q and k must share a dtype in {_DTYPES}, got {q.dtype} and {k.dtype}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != head_dim // 2:
        raise ValueError(
            f"cos and sin must both be (max_pos, {head_dim // 2}), got {tuple(cos.shape)} and "
            f"{tuple(sin.shape)}"
        )
    if not (cos.is_floating_point() and sin.is_floating_point()):
        raise ValueError(f"cos and sin must be float tensors, got {cos.dtype} and {sin.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k must be contiguous in their last (head_dim) dimension")
    if positions is None:
        positions = torch.arange(tokens, device=q.device)
    if positions.shape != (tokens,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32/int64 of shape ({tokens},), got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    for name, t in (("k", k), ("cos", cos), ("sin", sin), ("positions", positions)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    # Range check only where it is free: on a GPU it would cost a device-to-host sync.
    if not q.is_cuda and tokens and (positions.min() < 0 or positions.max() >= cos.shape[0]):
        raise ValueError(f"positions must lie in [0, {cos.shape[0]}) (the cos/sin table length)")
    return positions


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
    positions: torch.Tensor | None = None, impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (tokens, n_heads, D) and k (tokens, n_kv_heads, D) IN PLACE by their positions'
    angles (cos, sin: (max_pos, D/2)); returns (q, k).

    impl: "auto" (our Triton kernel on CUDA, torch on CPU), "triton" (our kernel; on a CPU
    it runs in Triton's interpreter), or "torch" (the reference, copied back into q and k).
    """
    positions = _check(q, k, cos, sin, positions)
    if not interpreter.use_triton(impl, q, "apply_rope"):
        q_out, k_out = rope_reference(q, k, cos, sin, positions)
        q.copy_(q_out)
        k.copy_(k_out)
        return q, k
    tokens, n_q_heads, head_dim = q.shape
    if tokens == 0:
        return q, k
    half = head_dim // 2
    cos_c, sin_c = cos.contiguous(), sin.contiguous()
    _rope_kernel[(tokens,)](
        q, k, cos_c, sin_c, positions.contiguous(),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_c.stride(0),
        n_q_heads, k.shape[1],
        HALF=half, BLOCK_D=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(max(n_q_heads, 1)),
        BLOCK_HK=triton.next_power_of_2(max(k.shape[1], 1)),
        num_warps=4,
    )
    return q, k
