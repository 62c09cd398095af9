"""The low-latency one-shot all-reduce (PeerAllReduce.low_latency: NCCL-style LL packets, data
and flag in one 8-byte store, no barrier) on every visible GPU: equal to NCCL's all_reduce on
integer-valued data (exact) in fp32 / bf16 / fp16 at the sizes it takes, the same bits as the
barrier one-shot on random data, in place, and inside a CUDA graph replayed with fresh inputs
between barrier one-shots, two-shots and the fused norm (the kernels share the call counters
and alternate halves), with and without programmatic dependent launch. Sizes it does not take
(not whole 16-byte vectors, above LL_MAX_BYTES) go to the other kernels."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from layer2_comm import PeerAllReduce

from .peer_checks import assert_every_rank_passes, exact_ints, nccl_sum

# (elements, dtype): LL sizes (whole 16-byte vectors, <= 64 KiB) and ones it leaves to the others
CASES = [(4, torch.float32), (1000, torch.float32), (16384, torch.float32),
         (8, torch.bfloat16), (4096, torch.bfloat16), (4104, torch.bfloat16),
         (32768, torch.bfloat16), (4096, torch.float16),
         (7, torch.bfloat16), (32 * 4096, torch.bfloat16)]


def _ll_checks() -> list[str]:
    bad: list[str] = []
    PeerAllReduce.low_latency = True  # read at construction: sizes the LL region
    ar = PeerAllReduce(max_bytes=1 << 20, timeout_s=10.0, debug=True)
    used = []
    original = ar._launch_ll
    ar._launch_ll = lambda x, out: (used.append(x.numel()), original(x, out))
    for i, (n, dtype) in enumerate(CASES):
        x = exact_ints(n, dtype, i)
        used.clear()
        got = ar(x)
        takes = n * x.element_size() % 16 == 0 and n * x.element_size() <= ar.LL_MAX_BYTES
        if bool(used) != takes:
            bad.append(f"{dtype} n={n}: LL used {bool(used)}, expected {takes}")
        if not torch.equal(got, nccl_sum(x)):
            bad.append(f"{dtype} n={n}: differs from NCCL")
    # random data: the same bits as the barrier one-shot, on every rank; in place
    for n in (4096, 12288):
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        ll = ar(x)
        ar.low_latency = False
        pulled = ar(x)
        ar.low_latency = True
        if not torch.equal(ll, pulled):
            bad.append(f"randn n={n}: LL and barrier one-shot differ")
        y = x.clone()
        if ar(y, out=y) is not y or not torch.equal(y, ll):
            bad.append(f"randn n={n}: in place differs")
    ar.debug = False
    for pdl in (False, True):
        ar.pdl = pdl
        bad += [f"pdl={pdl}: {b}" for b in _graph_checks(ar)]
    ar.check()
    ar.close()
    return bad


def _graph_checks(ar: PeerAllReduce) -> list[str]:
    bad: list[str] = []
    small = torch.zeros(4096, device="cuda", dtype=torch.bfloat16)  # LL
    mid = torch.zeros(32 * 4096, device="cuda", dtype=torch.bfloat16)  # barrier one-shot
    big = torch.zeros(200_000, device="cuda", dtype=torch.float32)  # two-shot (world > 2)
    rows = torch.zeros(3, 200, device="cuda", dtype=torch.bfloat16)  # the fused norm
    res = torch.zeros_like(rows)
    w = torch.ones(200, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ar(small), ar(mid), ar(big), ar.all_reduce_rms_norm(rows, res, w, 1e-5)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a = ar(small)
        b = ar(mid)
        c = ar(a)  # LL after LL: the sum of sums
        d = ar(big)
        y, h = ar.all_reduce_rms_norm(rows, res, w, 1e-5)
        e = ar(small)
    world = dist.get_world_size()
    for i in range(100):
        small.copy_(exact_ints(small.numel(), torch.bfloat16, 100 + i))
        mid.copy_(exact_ints(mid.numel(), torch.bfloat16, 300 + i))
        big.copy_(exact_ints(big.numel(), torch.float32, 500 + i))
        rows.copy_(exact_ints(rows.numel(), torch.bfloat16, 700 + i).view(3, 200))
        graph.replay()
        want = nccl_sum(small)
        if not (torch.equal(a, want) and torch.equal(b, nccl_sum(mid)) and torch.equal(c, want * world)
                and torch.equal(d, nccl_sum(big)) and torch.equal(e, want)
                and torch.equal(h, nccl_sum(rows) + res)):
            bad.append(f"graph replay {i}: differs from NCCL")
            break
    return bad


@pytest.mark.multigpu
def test_low_latency_one_shot_equalsnccl_sum():
    assert_every_rank_passes(_ll_checks, timeout_s=240)
