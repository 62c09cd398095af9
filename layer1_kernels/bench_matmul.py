"""Benchmarks for the compute-heavy Triton kernels: matmul, flash attention, int8 matmul.

`bench_cases(device)` hands bench.py one BenchCase per (kernel, shape), each beside the
library call it competes with, on the same already-allocated random inputs:
- matmul bf16 at 4096^3 and 8192^3 vs cuBLAS (torch.matmul); fp8 e4m3 at 8192^3 vs
  torch._scaled_mm on GPUs of compute capability >= 8.9 (roof "fp8");
- flash attention causal, B=4, N=4096, D=128, bf16, Hq=Hkv=32 and GQA Hq=32/Hkv=8, vs
  PyTorch SDPA restricted to its FlashAttention-2 backend;
- int8 weight-only matmul at M=1 and M=16 (decode), K=N=4096, vs cuBLAS bf16 on the
  dequantized weight. Memory-bound (roof None): a 16 MiB int8 weight fits in the 50 MB L2,
  so each call takes the next of several weight copies (> 2x L2 in all) and every call
  reads its weight from HBM, ours and the reference alike. Both sides are timed as CUDA
  graph replays: a ~10 us kernel would otherwise measure Python's launch cost.
Importable anywhere; building the cases needs a CUDA device (ValueError otherwise).
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from .bench_case import BenchCase
from .flash_attention import flash_attention
from .int8_matmul import int8_matmul, quantize_int8
from .matmul import matmul
from .matmul_fp8 import matmul_fp8

BF16 = torch.bfloat16


def _matmul_cases(dev: torch.device, gen: torch.Generator) -> list[BenchCase]:
    cases = []
    for n in (4096, 8192):
        a = torch.randn(n, n, device=dev, dtype=BF16, generator=gen)
        b = torch.randn(n, n, device=dev, dtype=BF16, generator=gen)
        cases.append(BenchCase(
            name=f"matmul {n}x{n}x{n} bf16", flops=2.0 * n**3, nbytes=3.0 * n * n * 2,
            ours=lambda a=a, b=b: matmul(a, b), reference=lambda a=a, b=b: torch.matmul(a, b),
            reference_name="cuBLAS (torch.matmul)", dtype="bf16"))
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None and torch.cuda.get_device_capability(dev) >= (8, 9):
        n = 8192
        a8 = torch.randn(n, n, device=dev, generator=gen).to(fp8)
        b8 = torch.randn(n, n, device=dev, generator=gen).to(fp8).T  # column-major, as cuBLAS wants
        one = torch.ones((), device=dev)
        cases.append(BenchCase(
            name=f"matmul_fp8 {n}x{n}x{n} e4m3 -> bf16", flops=2.0 * n**3,
            nbytes=2.0 * n * n + 2.0 * n * n,
            ours=lambda: matmul_fp8(a8, b8, one, one, BF16),
            reference=lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=BF16),
            reference_name="cuBLAS fp8 (torch._scaled_mm)", dtype="fp8"))
    return cases


def _sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def _attention_cases(dev: torch.device, gen: torch.Generator) -> list[BenchCase]:
    cases = []
    B, Hq, N, D = 4, 32, 4096, 128
    for Hkv in (32, 8):
        q = torch.randn(B, Hq, N, D, device=dev, dtype=BF16, generator=gen)
        k = torch.randn(B, Hkv, N, D, device=dev, dtype=BF16, generator=gen)
        v = torch.randn(B, Hkv, N, D, device=dev, dtype=BF16, generator=gen)
        ref_k, ref_v, gqa, ref_name = k, v, Hkv != Hq, "SDPA FlashAttention-2 backend"
        if gqa:
            try:  # flash backend with native GQA (torch >= 2.5); else repeat the kv heads
                _sdpa_flash(q[:, :, :128], k[:, :, :128], v[:, :, :128], gqa=True)
                ref_name += " (enable_gqa=True)"
            except RuntimeError:
                ref_k, ref_v = (t.repeat_interleave(Hq // Hkv, dim=1) for t in (k, v))
                gqa = False
                ref_name += " (kv heads repeated beforehand, untimed)"
        flops = 4.0 * B * Hq * N * N * D / 2  # causal with Nq == Nk: half the score matrix
        nbytes = 2.0 * (2 * B * Hq * N * D + 2 * B * Hkv * N * D)
        cases.append(BenchCase(
            name=f"flash_attention causal B={B} Hq={Hq} Hkv={Hkv} N={N} D={D} bf16",
            flops=flops, nbytes=nbytes,
            ours=lambda q=q, k=k, v=v: flash_attention(q, k, v, causal=True),
            reference=lambda q=q, k=ref_k, v=ref_v, g=gqa: _sdpa_flash(q, k, v, g),
            reference_name=ref_name, dtype="bf16"))
    return cases


def _graphed(fn, *args: torch.Tensor) -> torch.cuda.CUDAGraph:
    """Capture one call of fn(*args) in a CUDA graph (fn must already be warm / autotuned)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    return graph


def _int8_cases(dev: torch.device, gen: torch.Generator) -> list[BenchCase]:
    N = K = 4096
    copies = 8  # 8 x 16 MiB int8 (8 x 32 MiB bf16): several times the 50 MB L2
    quantized = [quantize_int8(torch.randn(N, K, device=dev, dtype=BF16, generator=gen))
                 for _ in range(copies)]
    dequantized = [(w.to(BF16) * s[:, None]).contiguous() for w, s in quantized]
    cases = []
    for M in (1, 16):
        x = torch.randn(M, K, device=dev, dtype=BF16, generator=gen)
        int8_matmul(x, *quantized[0])  # autotune now, outside any graph capture
        F.linear(x, dequantized[0])
        torch.cuda.synchronize(dev)
        # A decode-sized call runs ~10 us on the GPU but costs more than that to launch from
        # Python (Triton's launcher: ~80 us per call on the device VM, measured). Serving
        # replays CUDA graphs (layer 4), so time graph replays, one kernel each, both sides.
        ours_g = itertools.cycle([_graphed(int8_matmul, x, w, s) for w, s in quantized])
        ref_g = itertools.cycle([_graphed(F.linear, x, w) for w in dequantized])
        nbytes = N * K * 1 + M * K * 2 + N * 2 + M * N * 2  # int8 weight dominates
        cases.append(BenchCase(
            name=f"int8_matmul W8A16 M={M} K={K} N={N} bf16 (CUDA graph replay)",
            flops=2.0 * M * N * K, nbytes=float(nbytes),
            ours=lambda it=ours_g: next(it).replay(),
            reference=lambda it=ref_g: next(it).replay(),
            reference_name="cuBLAS bf16 F.linear on the dequantized weight, 2x the "
                           "bytes (CUDA graph replay)",
            dtype=None))
    return cases


def bench_cases(device: torch.device | str = "cuda") -> list[BenchCase]:
    """The matmul / attention / int8 cases, inputs allocated on `device` (a CUDA GPU)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"the matmul/attention benchmarks need a CUDA device, not {dev}")
    gen = torch.Generator(device=dev).manual_seed(0)
    return [*_matmul_cases(dev, gen), *_attention_cases(dev, gen), *_int8_cases(dev, gen)]
