"""The one-shot all-reduce with the residual add and RMSNorm in its epilogue
(PeerAllReduce.all_reduce_rms_norm): one kernel that must give what the all-reduce followed
by layer 1's rms_norm gives.

CPU: the reference it is checked against (the sum over ranks in fp32, rounded, plus the
residual, rounded, normalised as HF's LlamaRMSNorm) equals layer 1's rms_norm of the summed
rows, on fresh random inputs at awkward widths.
GPUs (multigpu, every visible GPU): the fused kernel against the two-launch path on fresh
random inputs (hidden sizes not multiples of 128, 1 / 3 / 32 rows, three dtypes), the same bits
on every rank, the fallback above the one-shot size, and inside a CUDA graph replayed with new
inputs between plain all-reduces (its buffers and flags are the all-reduce's), with and
without programmatic dependent launch.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import layer1_kernels as kernels
from layer2_comm import PeerAllReduce

from .peer_checks import assert_every_rank_passes

SHAPES = ((1, 48), (3, 200), (32, 4096), (5, 5120), (2, 1000), (32, 1003))


def reference(xs: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) from every rank's x: s = the fp32 sum in rank order rounded to x's dtype (the
    all-reduce), h = round(s + residual), y = round(round(h * rstd) * weight)."""
    s = torch.stack([x.float() for x in xs]).sum(0).to(xs[0].dtype)
    h = (s.float() + residual.float()).to(s.dtype)
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return (normed.float() * weight.float()).to(h.dtype), h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 48), (3, 200), (32, 130)])
def test_reference_is_the_sum_then_layer1_rms_norm(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows * 1000 + hidden)
    xs = [torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(3)]
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    y, h = reference(xs, residual, weight, 1e-5)
    s = torch.stack([x.float() for x in xs]).sum(0).to(dtype)
    want_y, want_h = kernels.rms_norm(s, weight, eps=1e-5, residual=residual, impl="torch")
    assert torch.equal(h, want_h)
    assert torch.equal(y, want_y)


# ---- GPUs ----------------------------------------------------------------------------
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(rows: int, hidden: int, dtype, salt: int):
    """This rank's partial x; the residual and weight every rank shares."""
    mine = torch.Generator().manual_seed(salt * 7919 + dist.get_rank() * 31 + rows * hidden)
    shared = torch.Generator().manual_seed(salt * 104729 + rows * hidden)
    x = torch.randn(rows, hidden, generator=mine).to(dtype)
    residual = torch.randn(rows, hidden, generator=shared).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=shared)).to(dtype)
    return x.cuda(), residual.cuda(), weight.cuda()


def _everyone(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _compare(what: str, got, x, residual, weight, eps, bad: list[str]) -> None:
    """got = (y, h) against the reference over every rank's x, and the same bits everywhere."""
    y, h = got
    want_y, want_h = reference(_everyone(x), residual, weight, eps)
    if not torch.equal(h, want_h):
        bad.append(f"{what}: h differs from the sum + residual "
                   f"(max {(h.float() - want_h.float()).abs().max().item():.3g})")
    tol = TOL[x.dtype]
    if not torch.allclose(y.float(), want_y.float(), rtol=tol, atol=tol):
        bad.append(f"{what}: y differs from the reference norm "
                   f"(max {(y.float() - want_y.float()).abs().max().item():.3g})")
    if not all(torch.equal(o, y) for o in _everyone(y)):
        bad.append(f"{what}: ranks disagree on y")


def _norm_checks() -> list[str]:
    bad: list[str] = []
    ar = PeerAllReduce(max_bytes=1 << 20, debug=True, timeout_s=10.0)
    eps = 1e-5
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for i, (rows, hidden) in enumerate(SHAPES):
            x, residual, weight = _inputs(rows, hidden, dtype, i)
            what = f"{dtype} {rows}x{hidden}"
            if not ar.fuses_norm(x) and rows * hidden * x.element_size() <= 256 << 10:
                bad.append(f"{what}: expected the fused kernel")
            got = ar.all_reduce_rms_norm(x, residual, weight, eps)
            _compare(what, got, x, residual, weight, eps, bad)
            two = kernels.rms_norm(ar(x), weight, eps=eps, residual=residual)
            if not torch.equal(got[1], two[1]):
                bad.append(f"{what}: h differs from the all-reduce + rms_norm launches")
    # above the one-shot size: the two launches (two-shot all-reduce, then the norm)
    ar.one_shot_max_bytes = 0
    x, residual, weight = _inputs(32, 4096, torch.bfloat16, 50)
    if ar.fuses_norm(x):
        bad.append("one_shot_max_bytes 0: still fused")
    _compare("fallback", ar.all_reduce_rms_norm(x, residual, weight, eps), x, residual, weight,
             eps, bad)
    ar.one_shot_max_bytes = 256 << 10
    try:
        ar.all_reduce_rms_norm(x, residual[:1], weight, eps)
        bad.append("a residual of another shape: no error")
    except ValueError:
        pass
    bad += _graph_checks(ar, eps)
    ar.pdl = True  # launched as programmatic dependents (as between layer 1's decode kernels)
    bad += [f"PDL: {b}" for b in _graph_checks(ar, eps)]
    ar.check()
    ar.close()
    return bad


def _graph_checks(ar: PeerAllReduce, eps: float) -> list[str]:
    """Fused calls and plain all-reduces captured in one graph, replayed with fresh inputs."""
    bad: list[str] = []
    ar.debug = False
    a = [t.clone() for t in _inputs(3, 200, torch.bfloat16, 70)]
    b = [t.clone() for t in _inputs(32, 4096, torch.bfloat16, 71)]
    plain = torch.zeros(1000, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        ar.all_reduce_rms_norm(*a, eps), ar(plain), ar.all_reduce_rms_norm(*b, eps)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_a = ar.all_reduce_rms_norm(*a, eps)
        got_plain = ar(plain)
        got_b = ar.all_reduce_rms_norm(*b, eps)
        got_b2 = ar.all_reduce_rms_norm(got_b[0], *b[1:], eps)  # chained, as block after block
    for i in range(60):
        for dst, src in ((a, _inputs(3, 200, torch.bfloat16, 1000 + i)),
                         (b, _inputs(32, 4096, torch.bfloat16, 2000 + i))):
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)
        plain.copy_(torch.randn(1000, generator=torch.Generator().manual_seed(i)).to(plain))
        graph.replay()
        torch.cuda.synchronize()
        before = len(bad)
        _compare(f"graph replay {i} (3x200)", got_a, *a, eps, bad)
        _compare(f"graph replay {i} (32x4096)", got_b, *b, eps, bad)
        _compare(f"graph replay {i} (chained)", got_b2, got_b[0], *b[1:], eps, bad)
        if not torch.equal(got_plain, ar(plain.clone())):
            bad.append(f"graph replay {i}: the plain all-reduce differs")
        if len(bad) > before:
            break
    ar.debug = True
    return bad


@pytest.mark.multigpu
def test_fused_all_reduce_norm_equals_the_two_launches():
    assert_every_rank_passes(_norm_checks, timeout_s=300)
