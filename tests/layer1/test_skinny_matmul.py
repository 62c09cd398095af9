"""Layer 1's skinny_matmul (a few dozen rows times a weight matrix, swap-AB on the tensor cores)
against the fp32 product at awkward sizes, and skinny_linear's choice: F.linear unless switched
on, on a GPU, at a tuned shape and a tuned row count. On a CPU the kernel runs through Triton's
interpreter in fp16 (the interpreter's bf16 dot is wrong); bf16 on a GPU."""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from layer1_kernels import skinny_linear, skinny_matmul, skinny_matmul_reference
from layer1_kernels.interpreter import kernel_device

SK = importlib.import_module("layer1_kernels.skinny_matmul")
DEV = kernel_device()
DTYPE = torch.bfloat16 if DEV.type == "cuda" else torch.float16


def _check(m: int, n: int, k: int, config, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEV, DTYPE)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEV, DTYPE)
    y = skinny_matmul(x, w, config=config)
    want = (x.double() @ w.double().T)
    assert y.shape == (m, n) and y.dtype == DTYPE
    err = ((y.double() - want).norm() / want.norm()).item()
    assert err < 1e-2, (m, n, k, config, err)
    assert torch.equal(skinny_matmul_reference(x, w), (x.float() @ w.float().T).to(DTYPE))


@pytest.mark.parametrize("m,n,k", [(1, 50, 70), (3, 33, 48), (32, 40, 64), (17, 16, 130)])
def test_skinny_matmul_at_awkward_sizes(m, n, k):
    cfg = (16, 32, 1, 1) if DEV.type == "cpu" else None
    _check(m, n, k, cfg, m * 1000 + n)
    _check(m, n, k, (32, 64, 4, 2) if DEV.type == "cpu" else (64, 128, 4, 3), m + n + k)
    # split K (3 parts of whole K tiles, the last one short where K is ragged), twice: the
    # arrival counters must be left at zero for the next call
    for seed in (1, 2):
        _check(m, n, k, (16, 16, 1, 1, 3) if DEV.type == "cpu" else (32, 32, 4, 2, 3), seed)


def test_skinny_matmul_refuses_bad_input():
    x = torch.zeros(3, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="x must be"):
        skinny_matmul(x, torch.zeros(4, 9, dtype=torch.float16))
    with pytest.raises(ValueError, match="rows"):
        skinny_matmul(torch.zeros(65, 8, dtype=torch.float16), torch.zeros(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="dtype"):
        skinny_matmul(x.float(), torch.zeros(4, 8))


def test_skinny_linear_is_f_linear_unless_chosen(monkeypatch):
    x, w, b = torch.randn(32, 16), torch.randn(8, 16), torch.randn(8)
    monkeypatch.setattr(SK, "ENABLED", True)
    monkeypatch.setitem(SK.TUNED, (8, 16), (16, 16, 1, 1))
    calls = []
    monkeypatch.setattr(SK, "skinny_matmul", lambda *a, **k: calls.append(a) or F.linear(*a))
    assert torch.equal(skinny_linear(x, w, b), F.linear(x, w, b))  # a CPU tensor: F.linear
    assert not calls


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 24, 32, 64])
def test_skinny_matmul_at_tp_shapes_gpu(m):
    """Rank 0's projections of Llama-3.1-8B at TP=1/2/4 (bf16)."""
    for i, tp in enumerate((1, 2, 4)):
        for j, (n, k) in enumerate(((6144 // tp, 4096), (4096, 4096 // tp), (28672 // tp, 4096),
                                    (4096, 14336 // tp))):
            _check(m, n, k, None, 10 * i + j)
            _check(m, n, k, (64, 128, 4, 3, 4), 10 * i + j)


@pytest.mark.gpu
def test_skinny_linear_takes_the_kernel_where_chosen_gpu(monkeypatch):
    x = torch.randn(32, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16) / 32
    calls = []
    original = SK.skinny_matmul
    monkeypatch.setattr(SK, "skinny_matmul", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setattr(SK, "ENABLED", True)
    monkeypatch.setitem(SK.TUNED, (4096, 1024), (32, 256, 4, 4))
    for rows, used in ((32, True), (24, True), (8, False), (33, False)):
        calls.clear()
        xi = x[:1].expand(rows, -1).contiguous() if rows > 32 else x[:rows]
        y = skinny_linear(xi, w)
        assert bool(calls) == used, rows
        torch.testing.assert_close(y.float(), F.linear(xi, w).float(), rtol=2e-2, atol=2e-2)


def test_skinny_matmul_compiles_for_sm90():
    """The real compiler (the interpreter accepts what it rejects), split K and not: tensor-core
    MMAs and the split's one atomic a column."""
    from .sm90 import run_compile_script

    code = """
from tests.layer1.sm90 import compile_for_sm90
from layer1_kernels.skinny_matmul import _skinny_kernel
for split in (1, 4):
    ck = compile_for_sm90(_skinny_kernel, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, EVEN_K=True,
                          SPLIT=split), {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16",
                          "part_ptr": "*fp32", "count_ptr": "*i32"},
                          {"num_warps": 4, "num_stages": 3}, aligned=True)
    ptx = ck.asm["ptx"]
    print(split, "mma" in ptx, ptx.count("atom."))
"""
    run = run_compile_script(code, "skinny_matmul's sm_90 compile")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.split()
    assert lines[:3] == ["1", "True", "0"] and lines[3:5] == ["4", "True"], run.stdout
    assert int(lines[5]) >= 1
