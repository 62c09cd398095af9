"""gemm_swiglu: the gate_up GEMM with SiLU-and-multiply in its epilogue, against the fp32
reference silu(x @ gate.T) * (x @ up.T): the pointer kernel and the persistent TMA kernel's
tiling in Triton's interpreter, the TMA kernel compiled for sm_90, both on a GPU."""
from __future__ import annotations

import pytest
import torch

from layer1_kernels.gemm_swiglu import (
    INTERPRETER_CONFIG,
    _launch_tma,
    gemm_swiglu,
    gemm_swiglu_reference,
    pick_config,
    uses_tma,
)
from layer1_kernels.swiglu import silu_and_mul


def operands(m: int, k: int, f: int, seed: int, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(2 * f, k, generator=gen) / k ** 0.5 * 2  # gates of O(1): both silu regimes
    return x.to(device, dtype), w.to(device, dtype)


def fp32_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    f = w.shape[0] // 2
    xd, wd = x.double(), w.double()
    return torch.nn.functional.silu(xd @ wd[:f].T) * (xd @ wd[f:].T)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# --- CPU, through Triton's interpreter ------------------------------------------------

@pytest.mark.interpreter
@pytest.mark.parametrize("m,k,f", [(37, 48, 40), (1, 16, 8), (16, 17, 16), (50, 5, 3)])
def test_pointer_kernel_matches_fp32(m: int, k: int, f: int) -> None:
    """Ragged in M, K and F (F not a tile multiple: the last gate tile's wrapped rows)."""
    x, w = operands(m, k, f, seed=m + k)
    y = gemm_swiglu(x, w, impl="triton")
    assert y.shape == (m, f) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), fp32_reference(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.interpreter
def test_fp16_rounds_once_from_fp32() -> None:
    x, w = operands(37, 48, 40, seed=1, dtype=torch.float16)
    y = gemm_swiglu(x, w, impl="triton")
    ref = fp32_reference(x, w)
    assert y.dtype == torch.float16
    # one rounding of the fp32 result: within an fp16 half-ulp (plus fp32 accumulation noise)
    assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -11 + 1e-4).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("m,k,f,sms", [(37, 48, 40, 3), (16, 32, 16, 1), (70, 64, 72, 7)])
def test_tma_kernel_tiling_in_interpreter(m: int, k: int, f: int, sms: int) -> None:
    """The Hopper kernel's persistent loop (several tiles a program), grouped order, and the
    ragged edges TMA handles (zero-filled K tail, gate tiles of a ragged F reading into the up
    half, stores past M and F dropped): run by the interpreter on CPU tensors."""
    x, w = operands(m, k, f, seed=f)
    y = torch.full((m, f), float("nan"))
    _launch_tma(x, w, y, INTERPRETER_CONFIG, sms)
    torch.testing.assert_close(y.double(), fp32_reference(x, w), atol=1e-5, rtol=1e-5)


def test_reference_and_bad_inputs() -> None:
    x, w = operands(5, 8, 6, seed=0)
    torch.testing.assert_close(gemm_swiglu(x, w), gemm_swiglu_reference(x, w))  # auto on CPU
    torch.testing.assert_close(gemm_swiglu(x, w).double(), fp32_reference(x, w), atol=1e-5,
                               rtol=1e-5)
    with pytest.raises(ValueError, match="w \\(2F, K\\)"):
        gemm_swiglu(x, w[:5])
    with pytest.raises(ValueError, match="w \\(2F, K\\)"):
        gemm_swiglu(x, w[:, :7])
    with pytest.raises(ValueError, match="dtypes differ"):
        gemm_swiglu(x, w.half())
    assert not uses_tma(x, w)  # CPU tensors


@pytest.mark.interpreter
def test_empty_rows_and_zero_k() -> None:
    x, w = operands(0, 8, 6, seed=0)
    assert gemm_swiglu(x, w, impl="triton").shape == (0, 6)
    y = gemm_swiglu(torch.empty(3, 0), torch.empty(8, 0), impl="triton")
    assert y.shape == (3, 4) and (y == 0).all()


def test_config_table() -> None:
    big = pick_config(2048, 8192, 2048, 132)
    assert (big["BLOCK_M"], big["BLOCK_N"]) == (128, 128)
    small = pick_config(128, 8192, 2048, 132)  # 64 tiles of 128 rows: fewer than the SMs
    assert small["BLOCK_M"] == 64


def test_tma_kernel_compiles_for_sm90() -> None:
    """The real compiler (the interpreter accepts code it rejects): wgmma from shared memory,
    TMA bulk tensor loads, and shared memory that fits an H100's 227 KB, for both table tiles."""
    from .sm90 import run_compile_script

    code = """
from tests.layer1.sm90 import compile_for_sm90
from layer1_kernels.gemm_swiglu import _gemm_swiglu_tma_kernel, pick_config
for m in (2048, 128):
    c = pick_config(m, 8192, 2048, 132)
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    ck = compile_for_sm90(_gemm_swiglu_tma_kernel,
                          dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=c["GROUP_M"]),
                          {"x_desc": f"tensordesc<bf16[{bm},{bk}]>",
                           "w_desc": f"tensordesc<bf16[{bn},{bk}]>",
                           "y_desc": f"tensordesc<bf16[{bm},{bn}]>"},
                          {"num_warps": c["num_warps"], "num_stages": c["num_stages"]})
    ptx = ck.asm["ptx"]
    print(bm, "wgmma" in ptx, "cp.async.bulk.tensor" in ptx, ck.metadata.shared <= 227 * 1024)
"""
    run = run_compile_script(code, "gemm_swiglu's sm_90 compile")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["128", "True", "True", "True", "64", "True", "True", "True"], \
        run.stdout


# --- GPU ------------------------------------------------------------------------------

def _unfused(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return silu_and_mul(torch.nn.functional.linear(x, w))  # what the model runs without it


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,f,dtype", [
    (2048, 2048, 8192, torch.bfloat16), (777, 2048, 8192, torch.bfloat16),
    (2048, 4096, 14336, torch.bfloat16), (777, 4096, 14336, torch.bfloat16),
    (130, 136, 200, torch.bfloat16), (128, 2048, 4096, torch.bfloat16),
    (777, 2048, 8192, torch.float16)])
def test_gpu_matches_unfused(m: int, k: int, f: int, dtype: torch.dtype) -> None:
    """1B and 8B shapes, prefill-sized and ragged rows, an F that is no tile multiple: within
    bf16 tolerance of cuBLAS + silu_and_mul and closer than it to the fp32 reference."""
    x, w = operands(m, k, f, seed=m, dtype=dtype, device="cuda")
    torch.full((m, f), float("nan"), dtype=dtype, device="cuda")  # an unwritten output shows
    y = gemm_swiglu(x, w)
    if torch.cuda.get_device_capability()[0] == 9:
        assert uses_tma(x, w)
    assert y.shape == (m, f) and torch.isfinite(y).all()
    ref = fp32_reference(x, w)
    unfused = _unfused(x, w)
    assert rel_err(y, unfused) < 1e-2
    assert rel_err(y, ref) <= rel_err(unfused, ref) * 1.1 + 1e-4


@pytest.mark.gpu
def test_gpu_strided_x_and_fp32_take_the_pointer_kernel() -> None:
    x, w = operands(300, 72, 100, seed=2, device="cuda")
    xs = torch.randn(72, 300, device="cuda").T  # column-major x: not a TMA operand here
    assert not uses_tma(xs, w) and not uses_tma(x, w)  # fp32
    assert rel_err(gemm_swiglu(x, w), fp32_reference(x, w)) < 5e-3  # tf32
    assert rel_err(gemm_swiglu(xs, w), fp32_reference(xs, w)) < 5e-3
