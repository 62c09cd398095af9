"""On every visible GPU (one rank each): PeerAllReduce.gemv_all_reduce with gemv_send on (the
GEMV sends its outputs as LL packets from its epilogue, a second kernel polls and sums) gives
the bits of layer 1's GEMV followed by the all-reduce (bf16 and fp16, odd N, both prologues),
between the other peer kernels (they share the call counters and the LL region's halves), and
inside a CUDA graph replayed 100 times with fresh inputs, with and without PDL."""
from __future__ import annotations

import pytest
import torch

import layer1_kernels as kernels
from layer2_comm import PeerAllReduce

from .peer_checks import assert_every_rank_passes, exact_ints, nccl_sum

# (N, K, silu, dtype): the 8B TP=2 o_proj and down shapes, odd N, a multi-block receive
CASES = [(4096, 2048, False, torch.bfloat16), (4096, 7168, True, torch.bfloat16),
         (4095, 512, False, torch.bfloat16), (1001, 256, True, torch.bfloat16),
         (2048, 1024, False, torch.float16), (9, 64, True, torch.float16),
         (32000, 128, False, torch.bfloat16)]


def _inputs(n, k, silu, dtype, salt):
    g = torch.Generator(device="cuda").manual_seed(salt + 1000 * torch.distributed.get_rank())
    x = torch.randn(1, 2 * k if silu else k, device="cuda", generator=g).to(dtype)
    w = (0.05 * torch.randn(n, k, device="cuda", generator=g)).to(dtype)
    return x, w


def _reference(ar, x, w, silu):
    """Layer 1's GEMV, then our all-reduce (the LL one-shot where it takes the size)."""
    return ar(kernels.gemv_silu_mul(x, w) if silu else kernels.gemv(x, w))


def _checks() -> list[str]:
    bad: list[str] = []
    PeerAllReduce.low_latency = True  # read at construction: sizes the LL region
    ar = PeerAllReduce(max_bytes=1 << 20, timeout_s=10.0, debug=True)
    ar.gemv_send = True
    small = exact_ints(4096, torch.bfloat16, 1)
    for pdl in (True, False):
        ar.pdl = pdl
        for i, (n, k, silu, dtype) in enumerate(CASES):
            x, w = _inputs(n, k, silu, dtype, i)
            if not ar.sends_from_gemv(x, w, silu):
                bad.append(f"N={n} K={k}: not on the fused path")
                continue
            got = ar.gemv_all_reduce(x, w, silu)
            ar.gemv_send = False
            want = _reference(ar, x, w, silu)
            ar.gemv_send = True
            if got.shape != (1, n) or not torch.equal(got, want):
                err = float((got.float() - want.float()).abs().max())
                bad.append(f"pdl={pdl} N={n} K={k} silu={silu} {dtype}: differs from gemv + "
                           f"all-reduce (max {err:.3g})")
            # the other kernels between: the LL one-shot, the barrier one-shot
            if not torch.equal(ar(small), nccl_sum(small)):
                bad.append(f"pdl={pdl} after N={n}: the LL one-shot differs from NCCL")
            mid = exact_ints(40_000, torch.bfloat16, i)
            if not torch.equal(ar(mid), nccl_sum(mid)):
                bad.append(f"pdl={pdl} after N={n}: the barrier one-shot differs from NCCL")
    ar.debug = False
    for pdl in (True, False):
        ar.pdl = pdl
        bad += [f"graph pdl={pdl}: {b}" for b in _graph_checks(ar)]
    ar.check()
    ar.close()
    return bad


def _graph_checks(ar: PeerAllReduce) -> list[str]:
    bad: list[str] = []
    x, w = _inputs(4096, 1024, False, torch.bfloat16, 7)
    gu, wd = _inputs(4096, 1792, True, torch.bfloat16, 8)
    small = torch.zeros(4096, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ar.gemv_all_reduce(x, w), ar(small), ar.gemv_all_reduce(gu, wd, silu=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a = ar.gemv_all_reduce(x, w)
        s = ar(small)
        b = ar.gemv_all_reduce(gu, wd, silu=True)
        c = ar.gemv_all_reduce(x, w)  # two in a row: the halves alternate
    g = torch.Generator(device="cuda").manual_seed(99 + torch.distributed.get_rank())
    for i in range(100):
        x.copy_(torch.randn(x.shape, device="cuda", generator=g).to(x.dtype))
        gu.copy_(torch.randn(gu.shape, device="cuda", generator=g).to(gu.dtype))
        small.copy_(exact_ints(small.numel(), torch.bfloat16, 200 + i))
        graph.replay()
        ar.gemv_send = False  # the references: layer 1's GEMV and the LL one-shot, eagerly
        want_a, want_b = _reference(ar, x, w, False), _reference(ar, gu, wd, True)
        ar.gemv_send = True
        if not (torch.equal(a, want_a) and torch.equal(b, want_b) and torch.equal(c, want_a)
                and torch.equal(s, nccl_sum(small))):
            bad.append(f"replay {i}: differs from the GEMVs and all-reduces run eagerly")
            break
    return bad


@pytest.mark.multigpu
def test_gemv_all_reduce_equals_gemv_then_all_reduce():
    assert_every_rank_passes(_checks, timeout_s=280)
