"""softmax: our fused and online Triton kernels (interpreted on CPU) against torch."""
from __future__ import annotations

import pytest
import torch

from layer1_kernels.interpreter import kernel_device
from layer1_kernels.softmax import MAX_FUSED_COLS, softmax, softmax_reference, softmax_triton

#: Where our kernels run: CUDA on a GPU machine, else the CPU through Triton's interpreter.
DEV = kernel_device()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def exact(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.double(), dim=-1)


@pytest.mark.parametrize("cols", [1, 17, 1000, 1537])
def test_single_block_matches_float64(cols: int) -> None:
    x = 3 * torch.randn(6, cols, generator=torch.Generator().manual_seed(cols)).to(DEV)
    y = softmax(x, impl="triton")
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, exact(x)) < 1e-5
    torch.testing.assert_close(y.sum(-1), torch.ones(6, device=DEV))


@pytest.mark.parametrize("cols,max_block", [(129, 128), (1000, 128), (1537, 256), (1000, 100)])
def test_online_path_matches_float64(cols: int, max_block: int) -> None:
    # max_block below cols forces the chunked online-softmax kernel (100: a non-power-of-2 cap).
    x = 3 * torch.randn(5, cols, generator=torch.Generator().manual_seed(cols + max_block)).to(DEV)
    y = softmax_triton(x, max_block=max_block)
    assert rel_err(y, exact(x)) < 1e-5


def test_online_path_through_public_api() -> None:
    x = torch.randn(2, MAX_FUSED_COLS + 1000, generator=torch.Generator().manual_seed(7)).to(DEV)
    assert rel_err(softmax(x, impl="triton"), exact(x)) < 1e-5


@pytest.mark.parametrize("max_block", [MAX_FUSED_COLS, 64])
def test_large_inputs_do_not_overflow(max_block: int) -> None:
    gen = torch.Generator().manual_seed(11)
    x = 1e4 * torch.randn(4, 300, generator=gen).to(DEV)
    x[0, :] = 1e4  # a constant row of huge values: uniform 1/300
    y = softmax_triton(x, max_block=max_block)
    assert torch.isfinite(y).all()
    assert rel_err(y, exact(x)) < 1e-5
    torch.testing.assert_close(y[0], torch.full((300,), 1 / 300, device=DEV))


def test_masked_entries_and_leading_dims() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 17, generator=gen).to(DEV)
    x[..., 5:9] = -float("inf")  # attention-style masking
    y = softmax(x, impl="triton")
    assert y.shape == (2, 3, 17)
    assert (y[..., 5:9] == 0).all()
    assert rel_err(y, exact(x)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("max_block", [MAX_FUSED_COLS, 128])
def test_half_precision_inputs(dtype: torch.dtype, max_block: int) -> None:
    x = (4 * torch.randn(3, 500, generator=torch.Generator().manual_seed(3))).to(DEV, dtype)
    y = softmax_triton(x, max_block=max_block)
    assert y.dtype == dtype
    assert rel_err(y, exact(x.float())) < 1e-2
    assert rel_err(y, softmax_reference(x)) < 1e-2


def test_impls_and_errors() -> None:
    x = torch.randn(3, 4)
    torch.testing.assert_close(softmax(x), torch.softmax(x, -1))
    torch.testing.assert_close(softmax(x, impl="torch"), torch.softmax(x, -1))
    assert softmax(torch.empty(0, 5, device=DEV), impl="triton").shape == (0, 5)
    with pytest.raises(ValueError, match="unknown impl"):
        softmax(x, impl="numpy")
    with pytest.raises(ValueError, match="unsupported dtype"):
        softmax(x.long(), impl="triton")
    with pytest.raises(ValueError, match="0-d"):
        softmax(torch.tensor(1.0), impl="triton")


# ---- GPU tier ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols", [(8192, 8192), (4096, 32768), (1000, 1537), (3, 50257)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)])
def test_gpu_matches_reference(rows: int, cols: int, dtype: torch.dtype, tol: float) -> None:
    x = (3 * torch.randn(rows, cols, device="cuda")).to(dtype)
    # Freed at once: the caching allocator hands this NaN-filled block to softmax's output,
    # so any element the kernel fails to write shows up as NaN.
    torch.full_like(x, float("nan"))
    y = softmax(x)
    assert torch.isfinite(y).all()
    assert rel_err(y, exact(x.float())) < tol


@pytest.mark.gpu
def test_gpu_large_inputs() -> None:
    x = 1e4 * torch.randn(64, 40000, device="cuda", dtype=torch.bfloat16)
    y = softmax(x)
    assert torch.isfinite(y.float()).all()
    assert rel_err(y, exact(x.float())) < 1e-2
