"""matmul / matmul_fp8: our tiled Triton kernel (interpreted on CPU) against torch."""
from __future__ import annotations

import pytest
import torch

from layer1_kernels.matmul import matmul, matmul_reference
from layer1_kernels.matmul_fp8 import matmul_fp8, matmul_fp8_reference

FP8 = getattr(torch, "float8_e4m3fn", None)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def randn(*shape: int, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


def poison(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> None:
    """Leave a NaN-filled block in the caching allocator: the next same-size output most
    likely lands on it, so any element the kernel fails to write stays NaN."""
    torch.full(shape, float("nan"), dtype=dtype, device=device)


# --- CPU, through Triton's interpreter ------------------------------------------------

@pytest.mark.parametrize("m,k,n", [(67, 93, 45), (1, 17, 1), (33, 16, 100), (5, 1, 7), (16, 32, 16)])
@pytest.mark.interpreter
def test_matches_float64(m: int, k: int, n: int) -> None:
    a, b = randn(m, k, seed=m), randn(k, n, seed=n + 1)
    c = matmul(a, b, impl="triton")
    assert c.shape == (m, n) and c.dtype == torch.float32
    assert rel_err(c, a.double() @ b.double()) < 1e-5


@pytest.mark.interpreter
def test_strided_operands_are_read_in_place() -> None:
    a = randn(45, 67, seed=1).T  # (67, 45), column-major
    b = randn(30, 45, seed=2).T  # (45, 30)
    assert not a.is_contiguous() and not b.is_contiguous()
    assert rel_err(matmul(a, b, impl="triton"), a.double() @ b.double()) < 1e-5


@pytest.mark.interpreter
def test_float16_in_interpreter() -> None:
    a, b = randn(40, 50, seed=3, dtype=torch.float16), randn(50, 30, seed=4, dtype=torch.float16)
    c = matmul(a, b, impl="triton")
    assert c.dtype == torch.float16
    assert rel_err(c, a.double() @ b.double()) < 2e-3


@pytest.mark.interpreter
def test_empty_and_zero_k() -> None:
    assert matmul(torch.ones(0, 5), torch.ones(5, 3), impl="triton").shape == (0, 3)
    c = matmul(torch.ones(4, 0), torch.ones(0, 3), impl="triton")
    assert c.shape == (4, 3) and (c == 0).all()


def test_auto_and_torch_paths_on_cpu() -> None:
    a, b = randn(9, 7, seed=5), randn(7, 11, seed=6)
    ref = a.double() @ b.double()
    assert rel_err(matmul(a, b), ref) < 1e-6
    assert rel_err(matmul(a, b, impl="torch"), ref) < 1e-6
    assert rel_err(matmul_reference(a, b), ref) < 1e-6


@pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")
@pytest.mark.interpreter
def test_fp8_in_interpreter() -> None:
    a8 = randn(33, 40, seed=7).to(FP8)
    b8 = randn(19, 40, seed=8).to(FP8).T  # column-major, the fast layout on GPUs
    sa, sb = torch.tensor(0.5), torch.tensor(3.0)
    ref = (a8.double() @ b8.double()) * 1.5
    for out_dtype, tol in ((torch.float32, 1e-6), (torch.float16, 2e-3)):
        c = matmul_fp8(a8, b8, sa, sb, out_dtype, impl="triton")
        assert c.dtype == out_dtype and c.shape == (33, 19)
        assert rel_err(c, ref) < tol
    assert rel_err(matmul_fp8_reference(a8, b8, sa, sb, torch.float32), ref) < 1e-6


@pytest.mark.interpreter
def test_bad_inputs_raise() -> None:
    a, b = torch.ones(4, 5), torch.ones(5, 3)
    with pytest.raises(ValueError, match="unknown impl"):
        matmul(a, b, impl="cuda")
    with pytest.raises(ValueError, match="inner dimensions"):
        matmul(a, torch.ones(4, 3))
    with pytest.raises(ValueError, match="2-D"):
        matmul(torch.ones(2, 4, 5), b)
    with pytest.raises(ValueError, match="dtypes differ"):
        matmul(a, b.half(), impl="triton")
    with pytest.raises(ValueError, match="unsupported dtype"):
        matmul(a.int(), b.int(), impl="triton")
    with pytest.raises(ValueError, match="different devices"):
        matmul(a, torch.ones(5, 3, device="meta"), impl="triton")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="bf16"):
            matmul(a.bfloat16(), b.bfloat16(), impl="triton")
    if FP8 is not None:
        a8, b8 = a.to(FP8), b.to(FP8)
        with pytest.raises(ValueError, match="one-element"):
            matmul_fp8(a8, b8, torch.ones(2), torch.ones(()))
        with pytest.raises(ValueError, match="unsupported dtype"):
            matmul_fp8(a, b, torch.ones(()), torch.ones(()))


# --- GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, 2e-3)])
@pytest.mark.parametrize("m,k,n", [(4096, 4096, 4096), (1000, 1537, 777), (1, 4096, 4096), (3000, 64, 17)])
def test_gpu_matches_reference(dtype: torch.dtype, tol: float, m: int, k: int, n: int) -> None:
    a, b = randn(m, k, seed=m, device="cuda", dtype=dtype), randn(k, n, seed=n, device="cuda", dtype=dtype)
    poison((m, n), dtype, "cuda")
    c = matmul(a, b)  # auto -> Triton on CUDA
    assert c.dtype == dtype and torch.isfinite(c).all()
    assert rel_err(c, a.double() @ b.double()) < tol  # fp32 runs as tf32: ~3e-4


@pytest.mark.gpu
@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("m,k,n", [(1000, 1032, 776), (8, 8, 8), (136, 4096, 8)])
def test_gpu_tma_path_ragged_tiles(m: int, k: int, n: int, a_t: bool, b_t: bool) -> None:
    """Row pitches TMA accepts (multiples of 16 bytes) but edge tiles ragged in M, N and K, in
    every row-/column-major combination: the Hopper path on a Hopper GPU, else the pointer one."""
    from layer1_kernels.matmul import _use_tma
    a = randn(k, m, seed=m).T if a_t else randn(m, k, seed=m)
    b = randn(n, k, seed=n + 1).T if b_t else randn(k, n, seed=n + 1)
    a, b = a.to("cuda", torch.bfloat16), b.to("cuda", torch.bfloat16)
    poison((m, n), torch.bfloat16, "cuda")
    c = matmul(a, b)
    if torch.cuda.get_device_capability()[0] == 9:
        assert _use_tma(a, b, c)
    assert c.shape == (m, n) and torch.isfinite(c).all()
    assert rel_err(c, a.double() @ b.double()) < 1e-2


@pytest.mark.gpu
def test_gpu_transposed_operand() -> None:
    a = randn(1024, 2048, seed=1, device="cuda", dtype=torch.bfloat16)
    w = randn(1536, 2048, seed=2, device="cuda", dtype=torch.bfloat16)  # nn.Linear layout
    assert rel_err(matmul(a, w.T), a.double() @ w.double().T) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")
def test_gpu_fp8() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability >= 8.9")
    m, k, n = 2048, 4096, 1536
    a8 = randn(m, k, seed=3, device="cuda").to(FP8)
    b8 = randn(n, k, seed=4, device="cuda").to(FP8).T
    sa, sb = torch.tensor(0.25, device="cuda"), torch.tensor(2.0, device="cuda")
    poison((m, n), torch.bfloat16, "cuda")
    c = matmul_fp8(a8, b8, sa, sb)
    assert c.dtype == torch.bfloat16 and torch.isfinite(c).all()
    assert rel_err(c, (a8.double() @ b8.double()) * 0.5) < 1e-2


def test_bench_cases_import_without_gpu() -> None:
    from layer1_kernels.bench_matmul import bench_cases
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA device"):
            bench_cases("cpu")


@pytest.mark.gpu
def test_gpu_bench_cases_run() -> None:
    from layer1_kernels.bench_matmul import bench_cases
    cases = bench_cases("cuda")
    assert len(cases) >= 6 and all(c.flops > 0 and c.nbytes > 0 for c in cases)
    for case in cases:
        case.ours()
        case.reference()
    torch.cuda.synchronize()
