"""Layer 1's skinny_matmul (a decode batch of rows times a weight matrix, swap-AB on the tensor
cores) against the fp32 product at awkward sizes, and skinny_linear's choice: F.linear unless
switched on, on a GPU, at a tuned shape and inside a tuned row range. On a CPU the kernel runs
through Triton's interpreter in fp16 (the interpreter's bf16 dot is wrong); bf16 on a GPU."""
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


@pytest.mark.parametrize("m,n,k", [(1, 50, 70), (3, 33, 48), (32, 40, 64), (17, 16, 130),
                                   (70, 24, 96)])
def test_skinny_matmul_at_awkward_sizes(m, n, k):
    cfg = (16, 16, 32, 1, 1) if DEV.type == "cpu" else None
    _check(m, n, k, cfg, m * 1000 + n)
    _check(m, n, k, (32, 32, 64, 4, 2) if DEV.type == "cpu" else (64, 64, 128, 4, 3), m + n + k)
    # split K (3 parts of whole K tiles, the last one short where K is ragged), twice: the
    # arrival counters must be left at zero for the next call
    for seed in (1, 2):
        _check(m, n, k, (16, 16, 16, 1, 1, 3) if DEV.type == "cpu" else (32, 32, 32, 4, 2, 3),
               seed)


def test_skinny_matmul_tiles_a_decode_batch_of_rows():
    """Up to MAX_ROWS rows in several row tiles (the last one partial), with and without split
    K, and the default tile for the row count."""
    for m, cfg in ((256, (16, 64, 32, 1, 1)), (200, (32, 64, 16, 1, 1, 2)), (130, None)):
        _check(m, 48, 64, cfg, m)


def test_skinny_matmul_refuses_bad_input():
    x = torch.zeros(3, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="x must be"):
        skinny_matmul(x, torch.zeros(4, 9, dtype=torch.float16))
    with pytest.raises(ValueError, match="rows"):
        skinny_matmul(torch.zeros(257, 8, dtype=torch.float16),
                      torch.zeros(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="dtype"):
        skinny_matmul(x.float(), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="config"):
        skinny_matmul(x, torch.zeros(4, 8, dtype=torch.float16), config=(16, 32, 1, 1))
    with pytest.raises(ValueError, match="config"):
        skinny_matmul(x, torch.zeros(4, 8, dtype=torch.float16), config=(16, 0, 32, 1, 1))


def test_tuned_config_picks_by_shape_and_rows(monkeypatch):
    monkeypatch.setitem(SK.TUNED, (8, 16), ((17, 32, (16, 32, 16, 1, 1)),
                                            (129, 256, (16, 128, 16, 1, 1, 2))))
    assert SK.tuned_config(8, 16, 24) == (16, 32, 16, 1, 1)
    assert SK.tuned_config(8, 16, 256) == (16, 128, 16, 1, 1, 2)
    assert SK.tuned_config(8, 16, 64) is None and SK.tuned_config(8, 16, 8) is None
    assert SK.tuned_config(16, 8, 24) is None


def test_skinny_linear_is_f_linear_unless_chosen(monkeypatch):
    x, w, b = torch.randn(32, 16), torch.randn(8, 16), torch.randn(8)
    monkeypatch.setitem(SK.TUNED, (8, 16), ((1, 256, (16, 32, 16, 1, 1)),))
    calls = []
    monkeypatch.setattr(SK, "skinny_matmul", lambda *a, **k: calls.append(a) or F.linear(*a))
    assert torch.equal(skinny_linear(x, w, b), F.linear(x, w, b))  # a CPU tensor: F.linear
    assert not calls


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 24, 32, 64, 136, 256])
def test_skinny_matmul_at_decode_shapes_gpu(m):
    """Rank 0's projections of Llama-3.1-8B at TP=1/2/4 and Llama-3.2-1B's (bf16), the default
    tile and a split-K one."""
    shapes = [(6144 // tp, 4096) for tp in (1, 2, 4)] + [(4096, 4096 // tp) for tp in (1, 2, 4)]
    shapes += [(28672 // tp, 4096) for tp in (1, 2, 4)] + [(4096, 14336 // tp) for tp in (1, 2, 4)]
    shapes += [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]
    for i, (n, k) in enumerate(shapes):
        _check(m, n, k, None, i)
        _check(m, n, k, (64, 64, 128, 4, 3, 4), i)


def test_tuned_table_is_well_formed():
    """Every TUNED entry: ordered, non-overlapping row ranges inside 1..MAX_ROWS, and configs
    skinny_matmul accepts (a config per range, its row tile a power of two >= 16)."""
    for (n, k), entries in SK.TUNED.items():
        last = 0
        for lo, hi, config in entries:
            assert last < lo <= hi <= SK.MAX_ROWS, ((n, k), lo, hi)
            assert len(config) in (5, 6) and all(isinstance(c, int) and c > 0 for c in config)
            assert config[1] >= 16 and config[1] & (config[1] - 1) == 0
            last = hi


@pytest.mark.gpu
def test_tuned_entries_are_correct_at_their_row_ranges_gpu():
    """Each TUNED config on its own shape at both ends of its row range (bf16)."""
    for i, ((n, k), entries) in enumerate(sorted(SK.TUNED.items())):
        for lo, hi, config in entries:
            for m in (lo, hi):
                _check(m, n, k, config, i * 1000 + m)


@pytest.mark.gpu
def test_skinny_linear_takes_the_kernel_where_chosen_gpu(monkeypatch):
    x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16) / 32
    calls = []
    original = SK.skinny_matmul
    monkeypatch.setattr(SK, "skinny_matmul", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setitem(SK.TUNED, (4096, 1024), ((17, 32, (32, 32, 256, 4, 4)),
                                                  (129, 256, (128, 128, 64, 8, 3, 2))))
    for rows, used in ((32, True), (24, True), (8, False), (33, False), (200, True),
                       (256, True), (257, False)):
        calls.clear()
        y = skinny_linear(x[:rows], w)
        assert bool(calls) == used, rows
        torch.testing.assert_close(y.float(), F.linear(x[:rows], w).float(), rtol=2e-2,
                                   atol=2e-2)


def test_skinny_matmul_compiles_for_sm90():
    """The real compiler (the interpreter accepts what it rejects), split K and not, a streaming
    tile and a wgmma-sized one: tensor-core MMAs, the K loop pipelined through shared memory
    (async copies: a K offset the compiler cannot prove 16-aligned would lose them), the
    split's one atomic a tile."""
    from .sm90 import run_compile_script

    code = """
from tests.layer1.sm90 import compile_for_sm90
from layer1_kernels.skinny_matmul import _skinny_kernel
for bm, bn, bk, warps, split in ((32, 64, 128, 4, 1), (32, 64, 128, 4, 4), (128, 128, 64, 8, 1)):
    ck = compile_for_sm90(_skinny_kernel, dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=True,
                          SPLIT_K=split > 1), {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16",
                          "part_ptr": "*fp32", "count_ptr": "*i32"},
                          {"num_warps": warps, "num_stages": 3}, aligned=True,
                          divisible=("K", "K_SPLIT"))
    ptx = ck.asm["ptx"]
    print(split, "mma" in ptx, "cp.async" in ptx, min(ptx.count("atom."), 1))
"""
    run = run_compile_script(code, "skinny_matmul's sm_90 compile")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["1", "True", "True", "0", "4", "True", "True", "1",
                                  "1", "True", "True", "0"], run.stdout
