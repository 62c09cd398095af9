"""CuPy / CUDA C kernels: the SGEMM progression, reduce_sum and the CuPy kernel examples.

On a CPU-only machine the public functions must raise the one clear RuntimeError, input
checks must still raise ValueError, and the torch references must be right; the numeric
tests (marked gpu) run on a CUDA machine with CuPy.
"""
from __future__ import annotations

import pytest
import torch

from layer1_kernels import bench_cuda, cupy_support, reduction
from layer1_kernels.sgemm import (
    BEST_VERSION,
    SGEMM_VERSIONS,
    resolve_version,
    sgemm,
    sgemm_reference,
)

MISSING = "CuPy kernels need a CUDA GPU and the cupy package"
no_cupy = pytest.mark.skipif(cupy_support.cupy_available(), reason="CuPy and a GPU are present here")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def rand(*shape: int, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=device, dtype=dtype)


# ------------------------------------------------------------------ CPU: errors and references
@no_cupy
@pytest.mark.parametrize("call", [
    lambda: sgemm(torch.ones(3, 4), torch.ones(4, 5)),
    lambda: sgemm(torch.ones(3, 4), torch.ones(4, 5), version=1),
    lambda: reduction.reduce_sum(torch.ones(10)),
    lambda: reduction.cupy_silu_mul(torch.ones(3), torch.ones(3)),
    lambda: reduction.cupy_row_rms(torch.ones(2, 3)),
    lambda: cupy_support.require_cupy(),
    lambda: bench_cuda.bench_cases("cpu"),
    lambda: bench_cuda.sgemm_progression_table(64),
], ids=["sgemm", "sgemm_v1", "reduce_sum", "silu_mul", "row_rms", "require_cupy", "bench_cases",
        "progression"])
def test_clear_error_without_cupy(call) -> None:
    assert not cupy_support.cupy_available()
    with pytest.raises(RuntimeError, match=MISSING):
        call()


@pytest.mark.parametrize("call,match", [
    (lambda: sgemm(torch.ones(3, 4), torch.ones(5, 6)), "inner dimensions"),
    (lambda: sgemm(torch.ones(3, 4, 1), torch.ones(4, 5)), "2-D"),
    (lambda: sgemm(torch.ones(3, 4, dtype=torch.float64), torch.ones(4, 5)), "dtype float32"),
    (lambda: sgemm([[1.0]], torch.ones(1, 1)), "torch.Tensor"),
    (lambda: sgemm(torch.ones(3, 4), torch.ones(4, 5), version=0), "1..7"),
    (lambda: sgemm(torch.ones(3, 4), torch.ones(4, 5), version="fastest"), "unknown SGEMM version"),
    (lambda: reduction.reduce_sum(torch.ones(2, 3)), "1-D"),
    (lambda: reduction.reduce_sum(torch.ones(3, dtype=torch.float16)), "dtype float32"),
    (lambda: reduction.cupy_silu_mul(torch.ones(3), torch.ones(4)), "same shape"),
    (lambda: reduction.cupy_silu_mul(torch.ones(3), torch.ones(3, dtype=torch.float16)),
     "same dtype"),
    (lambda: reduction.cupy_silu_mul(torch.ones(3, dtype=torch.bfloat16), torch.ones(3)),
     "dtype float32, float16"),
    (lambda: reduction.cupy_row_rms(torch.ones(3, 0)), "non-empty last dimension"),
])
def test_bad_inputs_raise_value_error(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_versions_in_reading_order() -> None:
    assert SGEMM_VERSIONS[:6] == ("naive", "coalesced", "smem_tiled", "blocktile_1d",
                                  "blocktile_2d", "vectorized")
    assert resolve_version(1) == "naive"
    assert resolve_version(len(SGEMM_VERSIONS)) == SGEMM_VERSIONS[-1]
    assert resolve_version("best") == BEST_VERSION in SGEMM_VERSIONS
    assert resolve_version("smem_tiled") == "smem_tiled"
    with pytest.raises(ValueError, match="unknown SGEMM version"):
        resolve_version(True)


def test_references_on_cpu() -> None:
    a, b = rand(17, 33, seed=1), rand(33, 9, seed=2)
    assert rel_err(sgemm_reference(a, b), a.double() @ b.double()) < 1e-6
    x = rand(1001, seed=3)
    assert abs(reduction.reduce_sum_reference(x).item() - x.double().sum().item()) < 1e-4
    g, u = rand(5, 7, seed=4), rand(5, 7, seed=5)
    expected = g.double() * torch.sigmoid(g.double()) * u.double()
    assert rel_err(reduction.cupy_silu_mul_reference(g, u), expected) < 1e-6
    x = rand(4, 37, seed=6)
    assert rel_err(reduction.cupy_row_rms_reference(x), x.double().pow(2).mean(-1).sqrt()) < 1e-6


# ------------------------------------------------------------------ GPU: numerics
gpu = pytest.mark.gpu


@pytest.fixture
def cupy():
    return pytest.importorskip("cupy")


def poison_allocator(numel: int) -> None:
    # Leave NaNs in the caching allocator's next block, so an element a kernel forgets to
    # write shows up as NaN instead of as a stale plausible value.
    torch.full((numel,), float("nan"), device="cuda")
    # (freed at once; the next allocation of this size reuses the block)


@gpu
@pytest.mark.parametrize("version", SGEMM_VERSIONS)
@pytest.mark.parametrize("m,n,k", [(127, 65, 33), (1000, 1000, 1000), (1024, 1024, 512),
                                   (1, 1, 1), (129, 260, 17), (256, 128, 64)])
def test_sgemm_matches_float64(cupy, version: str, m: int, n: int, k: int) -> None:
    a, b = rand(m, k, seed=m + k, device="cuda"), rand(k, n, seed=n + 7, device="cuda")
    poison_allocator(m * n)
    c = sgemm(a, b, version=version)
    assert c.shape == (m, n) and c.dtype == torch.float32 and c.is_contiguous()
    assert torch.isfinite(c).all()
    assert rel_err(c, a.double() @ b.double()) < 1e-4


@gpu
@pytest.mark.parametrize("version", ["vectorized", SGEMM_VERSIONS[-1], "best"])
def test_sgemm_misaligned_and_strided_inputs(cupy, version: str) -> None:
    m, n, k = 300, 200, 100
    # A view starting 4 bytes into its buffer: not 16-byte aligned, so the float4 kernels
    # must take the padded path. B transposed: not contiguous.
    buf = rand(m * k + 1, seed=11, device="cuda")
    a = buf[1:].view(m, k)
    b = rand(n, k, seed=12, device="cuda").t()
    assert a.data_ptr() % 16 != 0 and not b.is_contiguous()
    assert rel_err(sgemm(a, b, version=version), a.double() @ b.double()) < 1e-4


@gpu
def test_sgemm_empty_and_device_errors(cupy) -> None:
    assert sgemm(torch.ones(0, 3, device="cuda"), torch.ones(3, 4, device="cuda")).shape == (0, 4)
    z = sgemm(torch.ones(2, 0, device="cuda"), torch.ones(0, 4, device="cuda"))
    assert torch.equal(z, torch.zeros(2, 4, device="cuda"))
    with pytest.raises(ValueError, match="CUDA tensor"):
        sgemm(torch.ones(3, 4), torch.ones(4, 5))
    with pytest.raises(ValueError, match="CUDA tensor"):
        reduction.reduce_sum(torch.ones(3))


@gpu
@pytest.mark.parametrize("n", [1, 3, 1000, 4097, 10**7 + 3])
def test_reduce_sum_matches_float64(cupy, n: int) -> None:
    x = rand(n, seed=n, device="cuda")
    s = reduction.reduce_sum(x)
    assert s.shape == () and s.dtype == torch.float32 and s.device == x.device
    exact = x.double().sum().item()
    assert abs(s.item() - exact) <= 1e-5 * x.double().abs().sum().item() + 1e-6
    assert torch.equal(reduction.reduce_sum(x), s)  # two passes, no atomics: deterministic


@gpu
def test_reduce_sum_unaligned_view_and_empty(cupy) -> None:
    x = rand(100_003, seed=5, device="cuda")[1:]  # starts 4 bytes in: the scalar-load path
    total = reduction.reduce_sum(x).item()
    assert abs(total - x.double().sum().item()) <= 1e-5 * x.abs().sum().item()
    assert reduction.reduce_sum(torch.empty(0, device="cuda")).item() == 0.0


@gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
@pytest.mark.parametrize("shape", [(1,), (1000,), (37, 1537)])
def test_silu_mul_elementwise_kernel(cupy, dtype: torch.dtype, tol: float, shape) -> None:
    g = rand(*shape, seed=1, device="cuda", dtype=dtype)
    u = rand(*shape, seed=2, device="cuda", dtype=dtype)
    out = reduction.cupy_silu_mul(g, u)
    assert out.shape == g.shape and out.dtype == dtype
    assert rel_err(out, reduction.cupy_silu_mul_reference(g, u)) < tol
    # Strided (transposed) inputs go through CuPy's indexing unchanged.
    if len(shape) == 2:
        assert rel_err(reduction.cupy_silu_mul(g.t(), u.t()),
                       reduction.cupy_silu_mul_reference(g.t(), u.t())) < tol


@gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-5)])
@pytest.mark.parametrize("shape", [(1,), (1000,), (37, 1537), (3, 5, 17)])
def test_row_rms_reduction_kernel(cupy, dtype: torch.dtype, tol: float, shape) -> None:
    x = rand(*shape, seed=3, device="cuda", dtype=dtype)
    out = reduction.cupy_row_rms(x)
    assert out.shape == x.shape[:-1] and out.dtype == torch.float32
    assert rel_err(out, x.double().pow(2).mean(-1).sqrt()) < tol


@gpu
def test_kernels_follow_torch_stream(cupy) -> None:
    # Launched on torch's current stream: work queued on a side stream stays ordered.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        a, b = rand(512, 512, seed=1, device="cuda"), rand(512, 512, seed=2, device="cuda")
        c = sgemm(a, b)
        total = reduction.reduce_sum(c.flatten())
    side.synchronize()
    assert rel_err(c, a.double() @ b.double()) < 1e-4
    assert abs(total.item() - c.double().sum().item()) <= 1e-5 * c.abs().sum().item()


@gpu
def test_bench_cases_and_progression_table(cupy) -> None:
    cases = bench_cuda.bench_cases("cuda")
    assert len(cases) == len(SGEMM_VERSIONS) + 1
    assert all(c.flops > 0 and c.nbytes > 0 for c in cases)
    assert [c.dtype for c in cases] == ["fp32"] * len(SGEMM_VERSIONS) + [None]
    cases[-1].ours(), cases[-1].reference()
    torch.cuda.synchronize()
    rows = bench_cuda.sgemm_progression_table(n=512)
    assert [r["name"] for r in rows] == [*SGEMM_VERSIONS, "cuBLAS"]
    assert all(r["gflops"] > 0 and r["ratio_to_cublas"] > 0 for r in rows)
