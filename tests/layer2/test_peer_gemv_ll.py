"""The row-parallel GEMV with the LL all-reduce in its epilogue (PeerAllReduce.gemv_all_reduce,
peer_kernels.gemv_ll_kernel; off by default: LLM_STACK_PEER_GEMV) on every visible GPU: equal to
layer 1's GEMV followed by the all-reduce, eagerly and inside a CUDA graph replayed with fresh
inputs between other all-reduces, with and without programmatic dependent launch. Each poll of
the kernel gives up after the instance's timeout_s, so a broken exchange fails the test (a
timeout error) instead of hanging it."""
from __future__ import annotations

import pytest
import torch

from layer2_comm import PeerAllReduce

from .peer_checks import assert_every_rank_passes, exact_ints

# (N, K, silu): 8B TP=2's o_proj and down (layer 1's tuned tiles), awkward sizes (untuned
# tile, K not a multiple of it, N not of the tile), the smallest
GEMV_CASES = [(4096, 2048, False), (4096, 7168, True), (1000, 300, False), (246, 130, True),
              (2, 16, False)]


def _gemv_checks(ar: PeerAllReduce) -> list[str]:
    """gemv_all_reduce (the GEMV with the LL all-reduce in its epilogue) = layer 1's GEMV then
    the all-reduce: exact on integer data without SiLU (every order sums the same), within
    rounding with it; eager, then in a CUDA graph replayed with fresh inputs between other
    all-reduces (the per-word counters and halves across replays)."""
    import layer1_kernels as kernels

    bad: list[str] = []
    cases = []
    for i, (N, K, silu) in enumerate(GEMV_CASES):
        if silu:
            x = torch.randn(1, 2 * K, device="cuda", dtype=torch.bfloat16)
            w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
        else:
            x = exact_ints(K, torch.bfloat16, 1100 + i).view(1, K)
            w = exact_ints(N * K, torch.bfloat16, 1200 + i).view(N, K)
        if not ar.fuses_gemv(x, w, silu):
            bad.append(f"gemv {N}x{K} silu={silu}: not fused")
            continue
        want = ar(kernels.gemv_silu_mul(x, w) if silu else kernels.gemv(x, w))
        got = ar.gemv_all_reduce(x, w, silu)
        ok = torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2) if silu else \
            torch.equal(got, want)
        if not ok:
            bad.append(f"gemv {N}x{K} silu={silu}: differs from gemv + all-reduce "
                       f"(max {(got.float() - want.float()).abs().max().item():.3g})")
        cases.append((x, w, silu))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    small = torch.zeros(4096, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.stream(side):
        for x, w, silu in cases:
            ar.gemv_all_reduce(x, w, silu)
        ar(small)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = []
        for x, w, silu in cases:
            outs.append(ar.gemv_all_reduce(x, w, silu))
            ar(small)
        outs.append(ar.gemv_all_reduce(*cases[0]))  # the same words twice in one replay
    for r in range(20):
        for i, (x, _, _) in enumerate(cases):
            x.copy_(exact_ints(x.numel(), x.dtype, 1300 + 17 * r + i).view(x.shape))
        graph.replay()
        for j, (x, w, silu) in enumerate(cases + cases[:1]):
            want = ar(kernels.gemv_silu_mul(x, w) if silu else kernels.gemv(x, w))
            if not torch.allclose(outs[j].float(), want.float(), rtol=1e-2, atol=1e-2):
                bad.append(f"gemv graph replay {r}: output {j} differs")
                return bad
    return bad



def _checks() -> list[str]:
    PeerAllReduce.low_latency = True  # read at construction: sizes the LL regions
    ar = PeerAllReduce(max_bytes=1 << 20, timeout_s=5.0)
    bad: list[str] = []
    try:
        for pdl in (False, True):
            ar.pdl = pdl
            bad += [f"pdl={pdl}: {b}" for b in _gemv_checks(ar)]
            if bad:
                break
        ar.check()
    except RuntimeError as exc:  # a poll that timed out: the peers' packets never matched
        bad.append(str(exc))
    ar.close()
    return bad


@pytest.mark.multigpu
@pytest.mark.skipif(not PeerAllReduce.fused_gemv,
                    reason="the GEMV + LL all-reduce is off (LLM_STACK_PEER_GEMV=1 runs it and "
                           "this test); a GPU run with it on has not completed yet")
def test_gemv_with_the_ll_all_reduce_equals_gemv_then_all_reduce():
    assert_every_rank_passes(_checks, timeout_s=240)
