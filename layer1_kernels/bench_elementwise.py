"""Benchmark cases for the memory-bound kernels: vector add, softmax, norms, RoPE, SwiGLU.

Every case is sized to stream several times the H100's 50 MB L2 through DRAM, so the
timings measure memory bandwidth, not cache. nbytes is the FEWEST bytes a call must move
(each input read once, each output written once; the formulas in the kernels' docstrings),
so bytes / time is the achieved bandwidth, comparable with layer 0's measured copy
bandwidth. All these kernels are memory-bound (well under 1 FLOP per byte), so `dtype`
is None: they are judged against bandwidth, not FLOP/s.

Building the cases allocates about 6 GB on the device; nothing is timed here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .bench_case import BenchCase
from .norms import layer_norm, rms_norm, rms_norm_reference
from .rope import apply_rope, rope_cache
from .softmax import softmax
from .swiglu import silu_and_mul
from .vector_add import vector_add


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    return torch.randn(shape, dtype=torch.float32, device=device, generator=gen).to(dtype)


def _vector_add_case(dev: torch.device, gen: torch.Generator) -> BenchCase:
    n = 2**28  # 1 GiB per fp32 operand, 3 GiB moved per call
    x, y = _randn((n,), torch.float32, dev, gen), _randn((n,), torch.float32, dev, gen)
    out = torch.empty_like(x)
    return BenchCase(
        name="vector_add 2^28 fp32", flops=n, nbytes=3 * n * 4,
        ours=lambda: vector_add(x, y, out=out),
        reference=lambda: torch.add(x, y, out=out), reference_name="torch.add(out=)",
    )


def _softmax_case(rows: int, cols: int, dev: torch.device, gen: torch.Generator) -> BenchCase:
    x = _randn((rows, cols), torch.bfloat16, dev, gen)
    return BenchCase(
        name=f"softmax {rows}x{cols} bf16", flops=5 * rows * cols, nbytes=2 * rows * cols * 2,
        ours=lambda: softmax(x),
        reference=lambda: torch.softmax(x, dim=-1), reference_name="torch.softmax",
    )


def _norm_cases(dev: torch.device, gen: torch.Generator) -> list[BenchCase]:
    tokens, hidden, eps = 16384, 8192, 1e-6
    x = _randn((tokens, hidden), torch.bfloat16, dev, gen)
    r = _randn((tokens, hidden), torch.bfloat16, dev, gen)
    w = 1.0 + 0.1 * _randn((hidden,), torch.bfloat16, dev, gen)
    b = 0.1 * _randn((hidden,), torch.bfloat16, dev, gen)
    elems, w_bytes = tokens * hidden, hidden * 2
    return [
        BenchCase(
            name=f"rms_norm {tokens}x{hidden} bf16",
            flops=4 * elems,
            nbytes=2 * elems * 2 + w_bytes,
            ours=lambda: rms_norm(x, w, eps=eps),
            reference=lambda: rms_norm_reference(x, w, eps=eps),
            reference_name="eager torch (HF LlamaRMSNorm arithmetic)",
        ),
        BenchCase(
            name=f"rms_norm+residual {tokens}x{hidden} bf16",
            flops=5 * elems,
            nbytes=4 * elems * 2 + w_bytes,
            ours=lambda: rms_norm(x, w, eps=eps, residual=r),
            reference=lambda: rms_norm_reference(x, w, eps=eps, residual=r),
            reference_name="eager torch (x + residual, then HF LlamaRMSNorm arithmetic)",
        ),
        BenchCase(
            name=f"layer_norm {tokens}x{hidden} bf16",
            flops=7 * elems,
            nbytes=2 * elems * 2 + 2 * w_bytes,
            ours=lambda: layer_norm(x, w, b, eps=eps),
            reference=lambda: F.layer_norm(x, (hidden,), w, b, eps),
            reference_name="torch.nn.functional.layer_norm",
        ),
    ]


def _hf_rope_eager(q, k, cos, sin, positions):
    """HF's apply_rotary_pos_emb as a model runs it: tables gathered, duplicated to full width
    and cast to the activation dtype, math in that dtype, new tensors out."""
    c = torch.cat((cos[positions], cos[positions]), dim=-1).to(q.dtype)[:, None, :]
    s = torch.cat((sin[positions], sin[positions]), dim=-1).to(q.dtype)[:, None, :]

    def rotate_half(t):
        half = t.shape[-1] // 2
        return torch.cat((-t[..., half:], t[..., :half]), dim=-1)

    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def _rope_case(dev: torch.device, gen: torch.Generator) -> BenchCase:
    # Llama-3-8B attention shape: 32 query heads, 8 KV heads, head_dim 128.
    tokens, hq, hk, d = 16384, 32, 8, 128
    q = _randn((tokens, hq, d), torch.bfloat16, dev, gen)
    k = _randn((tokens, hk, d), torch.bfloat16, dev, gen)
    cos, sin = rope_cache(tokens, d, device=dev, dtype=torch.float32)
    positions = torch.arange(tokens, device=dev)
    elems = tokens * (hq + hk) * d
    return BenchCase(
        name=f"rope q{tokens}x{hq}x{d} k{tokens}x{hk}x{d} bf16 (in place)", flops=3 * elems,
        nbytes=2 * elems * 2 + tokens * d * 4 + tokens * 8,
        ours=lambda: apply_rope(q, k, cos, sin, positions=positions),
        reference=lambda: _hf_rope_eager(q, k, cos, sin, positions),
        reference_name="eager torch (HF apply_rotary_pos_emb, bf16, out of place)",
    )


def _swiglu_case(dev: torch.device, gen: torch.Generator) -> BenchCase:
    tokens, d = 16384, 14336  # Llama-3-8B MLP width
    x = _randn((tokens, 2 * d), torch.bfloat16, dev, gen)
    return BenchCase(
        name=f"silu_and_mul {tokens}x{2 * d} bf16", flops=5 * tokens * d,
        nbytes=3 * tokens * d * 2,
        ours=lambda: silu_and_mul(x),
        reference=lambda: F.silu(x[:, :d]) * x[:, d:], reference_name="eager torch F.silu(a) * b",
    )


def bench_cases(device: torch.device | str = "cuda") -> list[BenchCase]:
    """The memory-bound benchmark cases, inputs allocated on `device` (a CUDA GPU)."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    return [
        _vector_add_case(dev, gen),
        _softmax_case(8192, 8192, dev, gen),
        _softmax_case(4096, 32768, dev, gen),  # rows longer than MAX_FUSED_COLS: online path
        *_norm_cases(dev, gen),
        _rope_case(dev, gen),
        _swiglu_case(dev, gen),
    ]
