"""cuDNN's fused attention (through PyTorch's SDPA) for one sequence in the token-major layout:
the library kernel that flash_attention_tokens competes with, callable in its place.

Shapes: q (Nq, Hq, D), k and v (Nk, Hkv, D), any strides with the last one 1 (rows of a fused
qkv output) -> (Nq, Hq, D) in q's dtype. fp16/bf16 on a CUDA GPU (sm80+), D a multiple of 8
up to 128. Causal needs Nq == Nk: SDPA's is_causal is aligned top-left, layer 1's kernels
bottom-right; the two agree only on a square (a prompt with nothing cached).

GQA is native: cuDNN reads kv head h // (Hq / Hkv) for query head h, as our kernels do, so
k and v are passed as they are (Hkv heads); expanding them to Hq heads would copy
2 * Nk * Hq * D elements a layer (16 MiB at 2048 tokens of the 1B shape) for nothing.

The call is aten's `_scaled_dot_product_cudnn_attention` itself, not F.scaled_dot_product_attention
inside `sdpa_kernel(CUDNN_ATTENTION)`: the same kernel, without the backend selection and the
context manager's flag flips on every call (host time in each of a prefill's layers; none in a
CUDA graph's replay, into which the call is captured like any other). The result is the
kernel's own output buffer, allocated by torch like q (empty_like keeps q's stride order,
dense: token-major here), returned as a (Nq, Hq, D) view -- contiguous, so o_proj's reshape
copies nothing -- not copied into a caller's buffer.
"""
from __future__ import annotations

import math

import torch

from .flash_attention import _check_common

_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 128


def cudnn_attention_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                           causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [+ causal mask]) v for one sequence by cuDNN (module docstring).
    q (Nq, Hq, D), k/v (Nk, Hkv, D), Hq % Hkv == 0 -> (Nq, Hq, D). scale: 1/sqrt(D) if None.
    ValueError naming the problem for inputs cuDNN cannot take (off CUDA, fp32, D, causal
    with Nq != Nk)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (N, H, D); got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    (Nq, Hq, D), (Nk, Hkv, Dk) = q.shape, k.shape
    if D != Dk:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in head dim")
    _check_common(q, k, v, Hq, Hkv, Nk)
    if q.dtype not in _DTYPES:
        raise ValueError(f"cuDNN attention takes {_DTYPES}; got {q.dtype}")
    if D % 8 or D > _MAX_HEAD_DIM:
        raise ValueError(f"cuDNN attention needs a head dim that is a multiple of 8 up to "
                         f"{_MAX_HEAD_DIM}; got {D}")
    if causal and Nq != Nk:
        raise ValueError(f"causal cuDNN attention needs Nq == Nk (its mask is aligned "
                         f"top-left, ours bottom-right); got Nq {Nq}, Nk {Nk}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("q, k and v need unit stride along the head dim")
    if q.device.type != "cuda":
        raise ValueError(f"cudnn_attention_tokens runs cuDNN, which needs CUDA tensors; got "
                         f"{q.device} (flash_attention_tokens runs everywhere)")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if Nq == 0:
        return torch.empty_like(q)
    # (1, H, N, D) views with the batch stride outermost, as a (B, N, H, D) tensor's
    # .transpose(1, 2) has it: the layout cuDNN's attention is written for
    q4, k4, v4 = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q4, k4, v4, None, False, 0.0, bool(causal), False, scale=scale)[0]
    return out[0].transpose(0, 1)
