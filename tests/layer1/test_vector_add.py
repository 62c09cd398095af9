"""vector_add: our Triton kernel (interpreted on CPU) against torch's add."""
from __future__ import annotations

import pytest
import torch

from layer1_kernels.interpreter import kernel_device
from layer1_kernels.vector_add import vector_add, vector_add_reference


@pytest.mark.parametrize("n", [1, 17, 1000, 1537, 4099])
def test_matches_torch_at_awkward_lengths(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, generator=gen).to(DEV), torch.randn(n, generator=gen).to(DEV)
    out = vector_add(x, y, impl="triton")
    assert torch.equal(out, x + y)  # one fp32 add per element: bit-exact

#: Where our kernels run: CUDA on a GPU machine, else the CPU through Triton's interpreter.
DEV = kernel_device()


def test_any_shape_and_non_contiguous_inputs() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 29, generator=gen).to(DEV).t()  # transposed view, not contiguous
    y = torch.randn(29, 37, generator=gen).to(DEV)
    out = vector_add(x, y, impl="triton")
    assert out.shape == (29, 37)
    assert torch.equal(out, x + y)


def test_writes_into_out() -> None:
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(1025, generator=gen).to(DEV), torch.randn(1025, generator=gen).to(DEV)
    out = torch.full_like(x, float("nan"))  # poisoned: every element must be written
    result = vector_add(x, y, out=out, impl="triton")
    assert result is out
    assert torch.equal(out, x + y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(300, generator=gen).to(DEV, dtype), torch.randn(300, generator=gen).to(DEV, dtype)
    out = vector_add(x, y, impl="triton")
    assert out.dtype == dtype
    # Within one rounding step: Triton's interpreter rounds fp32 -> bf16 toward zero, where
    # torch (and the GPU) round to nearest even. The GPU test below checks bit-exactness.
    torch.testing.assert_close(out, vector_add_reference(x, y))


def test_auto_and_torch_impls_on_cpu() -> None:
    x, y = torch.randn(10), torch.randn(10)
    assert torch.equal(vector_add(x, y), x + y)
    assert torch.equal(vector_add(x, y, impl="torch"), x + y)
    assert vector_add(torch.empty(0, device=DEV), torch.empty(0, device=DEV), impl="triton").numel() == 0


def test_bad_inputs_raise() -> None:
    x = torch.randn(8)
    with pytest.raises(ValueError, match="same shape"):
        vector_add(x, torch.randn(9), impl="triton")
    with pytest.raises(ValueError, match="same dtype"):
        vector_add(x, x.double(), impl="triton")
    with pytest.raises(ValueError, match="unsupported dtype"):
        vector_add(x.int(), x.int(), impl="triton")
    with pytest.raises(ValueError, match="unsupported dtype"):
        vector_add(x.double(), x.double(), impl="triton")
    with pytest.raises(ValueError, match="unknown impl"):
        vector_add(x, x, impl="cuda")
    with pytest.raises(ValueError, match="out must match"):
        vector_add(x, x, out=torch.empty(8, dtype=torch.float64), impl="triton")


def test_bench_cases_importable_without_gpu() -> None:
    from layer1_kernels import bench_elementwise

    assert callable(bench_elementwise.bench_cases)


# ---- GPU tier ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_matches_torch(dtype: torch.dtype) -> None:
    n = (1 << 24) + 3
    x = torch.randn(n, device="cuda").to(dtype)
    y = torch.randn(n, device="cuda").to(dtype)
    out = torch.full_like(x, float("nan"))
    vector_add(x, y, out=out)
    assert torch.equal(out, x + y)


@pytest.mark.gpu
def test_gpu_bench_cases_agree_with_their_references() -> None:
    from layer1_kernels.bench_elementwise import bench_cases

    for case in bench_cases("cuda"):
        ref = case.reference()  # first: some kernels (RoPE) update their inputs in place
        refs = tuple(r.clone() for r in (ref if isinstance(ref, tuple) else (ref,)))
        ours = case.ours()
        outs = ours if isinstance(ours, tuple) else (ours,)
        for o, r in zip(outs, refs, strict=True):
            err = ((o.float() - r.float()).norm() / r.float().norm()).item()
            assert err < 1e-2, f"{case.name}: relative error {err:.2e}"
        del ref, ours, refs, outs
    torch.cuda.empty_cache()
