"""Layer 1's one-launch decode MLP (gemv_mlp.py) against the two-kernel path's references: a
ragged last feature slice and output tile, one and three rows, the residual written, and the
split-K counters left at zero (a second call gives the same bits). On a CPU through Triton's
interpreter (fp32 / fp16); on a GPU also the model shapes in bf16 under CUDA-graph replay."""
from __future__ import annotations

import importlib

import pytest
import torch

from layer1_kernels import (
    gemv_mlp,
    gemv_mlp_reference,
    gemv_rms_norm,
    gemv_silu_mul,
)
from layer1_kernels.interpreter import kernel_device

GM = importlib.import_module("layer1_kernels.gemv_mlp")

DEV = kernel_device()
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV.type == "cuda" else [torch.float16])


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


def _inputs(m, h, f, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(m, h, generator=g).to(DEV, dtype) for _ in range(2))
    w_gu = (torch.randn(2 * f, h, generator=g) / h ** 0.5).to(DEV, dtype)
    w_d = (torch.randn(h, f, generator=g) / f ** 0.5).to(DEV, dtype)
    nw = (1 + 0.3 * torch.randn(h, generator=g)).to(DEV, dtype)
    return x, r, w_gu, w_d, nw


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("config", [(16, 16, 16, 1), (16, 32, 32, 1)])
def test_gemv_mlp_matches_two_kernels(dtype, m, config):
    # K = H = 48, F = 40: the last of three 16-feature slices is ragged; at BLOCK_H 32 so is
    # the last output tile, and BLOCK_K 32 leaves a ragged K step
    x, r, w_gu, w_d, nw = _inputs(m, 48, 40, dtype, seed=m)
    y_ref, h_ref = gemv_mlp_reference(x, w_gu, w_d, nw, 1e-6, r)
    y, h = gemv_mlp(x, w_gu, w_d, nw, 1e-6, r, impl="triton", config=config)
    assert torch.equal(h, h_ref)  # the new residual exactly
    assert y.shape == (m, 48) and rel(y, y_ref) < tol(dtype)
    y2, _ = gemv_mlp(x, w_gu, w_d, nw, 1e-6, r, impl="triton", config=config)
    assert torch.equal(y, y2)  # the counters were reset: the second call sums the same way
    _, count = GM._WORK[x.device]
    assert not count.any()
    # the two kernels it replaces give the same answer
    gu, h2 = gemv_rms_norm(x, w_gu, nw, 1e-6, r, impl="triton")
    assert torch.equal(h2, h) and rel(y, gemv_silu_mul(gu, w_d, impl="triton")) < tol(dtype)


def test_gemv_mlp_without_residual():
    x, _, w_gu, w_d, nw = _inputs(1, 48, 40, torch.float32)
    y, h = gemv_mlp(x, w_gu, w_d, nw, 1e-5, impl="triton")
    assert h is None and rel(y, gemv_mlp_reference(x, w_gu, w_d, nw, 1e-5)[0]) < 1e-5


def test_gemv_mlp_torch_impl_is_the_reference():
    x, r, w_gu, w_d, nw = _inputs(2, 32, 24, torch.float32)
    y, h = gemv_mlp(x, w_gu, w_d, nw, 1e-6, r, impl="torch")
    y_ref, h_ref = gemv_mlp_reference(x, w_gu, w_d, nw, 1e-6, r)
    assert torch.equal(y, y_ref) and torch.equal(h, h_ref)


def test_gemv_mlp_rejects_bad_shapes():
    x, r, w_gu, w_d, nw = _inputs(1, 32, 24, torch.float32)
    with pytest.raises(ValueError, match="w_down"):
        gemv_mlp(x, w_gu, w_d.T.contiguous(), nw, 1e-6, r, impl="triton")
    with pytest.raises(ValueError, match="2F"):
        gemv_mlp(x, w_gu[:-1], w_d, nw, 1e-6, r, impl="triton")
    with pytest.raises(ValueError, match="rows"):
        gemv_mlp(x.expand(9, 32).contiguous(), w_gu, w_d, nw, 1e-6, None, impl="triton")
    with pytest.raises(ValueError, match="config"):
        gemv_mlp(x, w_gu, w_d, nw, 1e-6, r, impl="triton", config=(16, 16, 24, 1))


# ---- GPU: the model shapes in bf16, graph replay ------------------------------------------------
#: (H, F) of Llama-3.2-1B and of Llama-3.1-8B's rank 0 at TP=1/2/4
SHAPES = [(2048, 8192), (4096, 14336), (4096, 7168), (4096, 3584)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hidden,ffn", SHAPES)
@pytest.mark.parametrize("m", [1, 2])
def test_gemv_mlp_model_shapes_graph_replay(hidden, ffn, m):
    x, r, w_gu, w_d, nw = _inputs(m, hidden, ffn, torch.bfloat16, seed=hidden + ffn)
    gu, h2 = gemv_rms_norm(x, w_gu, nw, 1e-5, r)
    y2 = gemv_silu_mul(gu, w_d)
    y, h = gemv_mlp(x, w_gu, w_d, nw, 1e-5, r)  # first call: the workspace, outside capture
    assert torch.equal(h, h2) and rel(y, y2) < 1e-2
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg, hg = gemv_mlp(x, w_gu, w_d, nw, 1e-5, r)
    outs = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        outs.append(yg.clone())
    assert all(torch.equal(o, y) for o in outs) and torch.equal(hg, h)


# ---- compiled for sm_90 (any machine): the interpreter accepts code the compiler rejects -------
COMPILE = r'''
import importlib
from tests.layer1.sm90 import compile_for_sm90 as compile_
GM = importlib.import_module("layer1_kernels.gemv_mlp")
for bm, bf, bk, bh, k, f, st in [(1, 64, 128, 256, 2048, 8192, 3), (1, 32, 128, 256, 4096, 3584, 1),
                                 (2, 64, 32, 32, 2048, 8192, 1)]:
    kern = compile_(GM._gemv_mlp_kernel, dict(K=k, F=f, HAS_RESIDUAL=True, BLOCK_M=bm,
                    BLOCK_F=bf, BLOCK_K=bk, BLOCK_H=bh, TILES_H=k // bh, RED_P=32,
                    EVEN_K=True, STATS_K=min(k, 8192 // bm), STAGES=st, PDL=True,
                    PDL_EARLY=False),
                    {"part_ptr": "*fp32", "count_ptr": "*i32", "nw_ptr": "*bf16"},
                    {"num_warps": 8, "launch_pdl": True}, aligned=True)
    ptx = kern.asm["ptx"]
    assert "atom" in ptx and "griddepcontrol.wait" in ptx, (bm, bf)
    assert bm > 1 or "ld.global.v4" in ptx or "cp.async" in ptx, (bm, bf)  # 16-byte weight loads
# the 1B's default config (one wave on 132 SMs) spills no registers (ptxas -v)
import pathlib, subprocess, tempfile, triton
kern = compile_(GM._gemv_mlp_kernel, dict(K=2048, F=8192, HAS_RESIDUAL=True, BLOCK_M=1,
                BLOCK_F=64, BLOCK_K=128, BLOCK_H=256, TILES_H=8, RED_P=32, EVEN_K=True,
                STATS_K=2048, STAGES=1, PDL=True, PDL_EARLY=False),
                {"part_ptr": "*fp32", "count_ptr": "*i32", "nw_ptr": "*bf16"},
                {"num_warps": 8, "launch_pdl": True}, aligned=True)
with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as fh:
    fh.write(kern.asm["ptx"])
ptxas = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
info = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", fh.name, "-o", "/dev/null"],
                      capture_output=True, text=True).stderr
assert "0 bytes spill stores" in info, info
print("compiled")
'''


def test_gemv_mlp_compiles_for_sm90():
    from .sm90 import run_compile_script
    run = run_compile_script(COMPILE, "compiling gemv_mlp")
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]
