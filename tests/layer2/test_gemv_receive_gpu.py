"""On every visible GPU (one rank each): the all-reduce received inside the next GEMV (gemv_send
and gemv_receive on: gemv_all_reduce(defer=True) returns a PendingSum, which gate_up's norm
GEMV or the qkv GEMV with RoPE and the cache write receives in its prologue) gives the bits of
the unfused chain (the receive kernel, then layer 1's GEMV): y, the new residual h, the cache
rows; between the other peer kernels (they share the counters and the LL halves); and inside
a CUDA graph of a decoder-layer-like chain replayed 100 times with fresh inputs, PDL on/off."""
from __future__ import annotations

import pytest
import torch

import layer1_kernels as kernels
from layer2_comm import PeerAllReduce

from .peer_checks import assert_every_rank_passes, exact_ints, nccl_sum

EPS = 1e-5
HQ, HKV, D = 16, 4, 128  # Llama-3.1-8B's rank at TP=2
#: (sender N = receiver K, sender K, silu, receiver rows or "rope", dtype): 8B TP=2's o_proj ->
#: gate_up and down -> qkv, a small K, fp16
CASES = [(4096, 2048, False, 14336, torch.bfloat16), (4096, 7168, True, "rope", torch.bfloat16),
         (512, 256, True, 96, torch.bfloat16), (2048, 1024, False, 4096, torch.float16),
         (4096, 512, False, "rope", torch.float16)]


def _rand(g, *shape, scale=1.0, dtype=torch.bfloat16):
    return (scale * torch.randn(*shape, device="cuda", generator=g)).to(dtype)


def _case(n, k, silu, recv, dtype, salt):
    """(x, w) of this rank's sender; the receiver's weights, norm, residual (the same on every
    rank, as in a TP forward) and RoPE inputs (None for a norm GEMV)."""
    rank = torch.distributed.get_rank()
    g = torch.Generator(device="cuda").manual_seed(salt + 1000 * rank)
    x = _rand(g, 1, 2 * k if silu else k, dtype=dtype)
    w = _rand(g, n, k, scale=0.05, dtype=dtype)
    g = torch.Generator(device="cuda").manual_seed(salt)  # shared by the ranks
    rows = (HQ + 2 * HKV) * D if recv == "rope" else recv
    wr = _rand(g, rows, n, scale=0.05, dtype=dtype)
    nw = 1 + _rand(g, n, scale=0.1, dtype=dtype)
    res = _rand(g, 1, n, dtype=dtype)
    rope = None
    if recv == "rope":
        ang = torch.rand(64, D // 2, device="cuda", generator=g) * 6.28
        rope = dict(cos=ang.cos(), sin=ang.sin(), positions=torch.tensor([37], device="cuda"),
                    slots=torch.tensor([5], device="cuda"),
                    k_cache=torch.zeros(8, HKV, D, dtype=dtype, device="cuda"),
                    v_cache=torch.zeros(8, HKV, D, dtype=dtype, device="cuda"))
    return x, w, wr, nw, res, rope


def _consume(s, wr, nw, res, rope):
    """The receiver: s a PendingSum (the fused GEMV: None where it does not take it) or the
    sum (layer 1's GEMV) -> (y, h)."""
    if rope is None:
        if isinstance(s, torch.Tensor):
            return kernels.gemv_rms_norm(s, wr, nw, EPS, res)
        return s.norm_gemv(wr, nw, EPS, res)
    args = (rope["cos"], rope["sin"], rope["positions"], rope["k_cache"], rope["v_cache"],
            rope["slots"], HQ, HKV, D)
    if isinstance(s, torch.Tensor):
        return kernels.gemv_rms_norm_rope(s, wr, nw, EPS, res, None, *args)
    return s.norm_gemv_rope(wr, nw, EPS, res, None, *args)


def _fresh(rope):
    return None if rope is None else {**rope, "k_cache": torch.zeros_like(rope["k_cache"]),
                                      "v_cache": torch.zeros_like(rope["v_cache"])}


def _checks() -> list[str]:
    bad: list[str] = []
    PeerAllReduce.low_latency = True  # read at construction: sizes the LL region
    ar = PeerAllReduce(max_bytes=1 << 20, timeout_s=10.0, debug=True)
    ar.gemv_send = ar.gemv_receive = True
    small = exact_ints(4096, torch.bfloat16, 1)
    for pdl in (True, False):
        ar.pdl = pdl
        for i, (n, k, silu, recv, dtype) in enumerate(CASES):
            x, w, wr, nw, res, rope = _case(n, k, silu, recv, dtype, i)
            where = f"pdl={pdl} N={n} K={k} silu={silu} -> {recv} {dtype}"
            pending = ar.gemv_all_reduce(x, w, silu, defer=True)
            if isinstance(pending, torch.Tensor):
                bad.append(f"{where}: not deferred")
                continue
            mine = _fresh(rope)
            got = _consume(pending, wr, nw, res, mine)
            if got is None:
                bad.append(f"{where}: the GEMV did not take the pending sum")
                continue
            want = _consume(ar.gemv_all_reduce(x, w, silu), wr, nw, res, rope)  # unfused
            for name, a, b in (("y", got[0], want[0]), ("h", got[1], want[1])):
                if not torch.equal(a, b):
                    err = float((a.float() - b.float()).abs().max())
                    bad.append(f"{where}: {name} differs from receive + GEMV (max {err:.3g})")
            if rope is not None and not (torch.equal(mine["k_cache"], rope["k_cache"])
                                         and torch.equal(mine["v_cache"], rope["v_cache"])):
                bad.append(f"{where}: the cache rows differ")
            if not torch.equal(ar(small), nccl_sum(small)):
                bad.append(f"{where}: the LL one-shot after it differs from NCCL")
            mid = exact_ints(40_000, torch.bfloat16, i)
            if not torch.equal(ar(mid), nccl_sum(mid)):
                bad.append(f"{where}: the barrier one-shot after it differs from NCCL")
    ar.debug = False
    for pdl in (True, False):
        ar.pdl = pdl
        bad += [f"graph pdl={pdl}: {b}" for b in _graph_checks(ar)]
    ar.check()
    ar.close()
    return bad


def _chain(ar, c, fused: bool):
    """A decoder layer's shape at TP=2: o_proj -> gate_up -> down -> qkv (+ RoPE) -> o_proj ->
    a plain receive (the LM head's). fused: every sum received in the next GEMV."""
    def sent(x, w, silu):
        return ar.gemv_all_reduce(x, w, silu, defer=fused)

    s = sent(c["a"], c["o"], False)
    gu, h = _consume(s, c["gu"], c["n2"], c["r"], None)
    s = sent(gu, c["down"], True)
    qkv, h2 = _consume(s, c["qkv"], c["n1"], h, c["rope"])
    s = sent(qkv[:, :c["o"].shape[1]].contiguous(), c["o"], False)
    last = s if isinstance(s, torch.Tensor) else s.receive()
    return gu, h, qkv, h2, last


def _graph_checks(ar: PeerAllReduce) -> list[str]:
    bad: list[str] = []
    rank = torch.distributed.get_rank()
    g = torch.Generator(device="cuda").manual_seed(7 + 1000 * rank)
    gs = torch.Generator(device="cuda").manual_seed(7)
    f, q = 7168, HQ * D  # gate_up -> (1, 2f) = [gate | up]; down (4096, f)
    c = dict(a=_rand(g, 1, q), o=_rand(g, 4096, q, scale=0.05), gu=_rand(gs, 2 * f, 4096,
             scale=0.05), down=_rand(g, 4096, f, scale=0.05), qkv=_rand(gs, (HQ + 2 * HKV) * D,
             4096, scale=0.05), n1=1 + _rand(gs, 4096, scale=0.1),
             n2=1 + _rand(gs, 4096, scale=0.1), r=_rand(gs, 1, 4096))
    c["rope"] = _case(4096, 512, False, "rope", torch.bfloat16, 3)[5]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _chain(ar, c, True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _chain(ar, c, True)
    for i in range(100):
        c["a"].copy_(_rand(g, 1, q))
        c["r"].copy_(_rand(gs, 1, 4096))
        c["rope"]["positions"].fill_(i % 64)
        graph.replay()
        cache = [t.clone() for t in (c["rope"]["k_cache"], c["rope"]["v_cache"])]
        want = _chain(ar, c, False)  # eagerly, unfused: receive kernels, layer 1's GEMVs
        same = all(torch.equal(a, b) for a, b in zip(outs, want, strict=True))
        if not same or not torch.equal(cache[0], c["rope"]["k_cache"]) \
                or not torch.equal(cache[1], c["rope"]["v_cache"]):
            names = [n for n, a, b in zip(("gate_up", "h", "qkv", "h2", "last"), outs, want,
                                          strict=True) if not torch.equal(a, b)]
            bad.append(f"replay {i}: differs from the unfused chain run eagerly: {names}")
            break
    return bad


@pytest.mark.multigpu
def test_the_sum_received_in_the_gemv_equals_receive_then_gemv():
    assert_every_rank_passes(_checks, timeout_s=280)
