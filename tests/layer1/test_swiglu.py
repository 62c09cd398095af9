"""silu_and_mul against F.silu(a) * b."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from layer1_kernels.interpreter import kernel_device
from layer1_kernels.swiglu import silu_and_mul, silu_and_mul_reference

#: Where our kernels run: CUDA on a GPU machine, else the CPU through Triton's interpreter.
DEV = kernel_device()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def exact(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x = x.double()
    return F.silu(x[..., :d]) * x[..., d:]


@pytest.mark.parametrize("d", [1, 17, 1000, 1537])
def test_matches_float64(d: int) -> None:
    x = 3 * torch.randn(5, 2 * d, generator=torch.Generator().manual_seed(d)).to(DEV)
    y = silu_and_mul(x, impl="triton")
    assert y.shape == (5, d) and y.dtype == x.dtype
    assert rel_err(y, exact(x)) < 1e-5


# numpy (under the interpreter) warns when exp(100) overflows to inf; inf is the intended value.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_extreme_values_and_leading_dims() -> None:
    x = torch.tensor([[-100.0, 0.0, 100.0, 2.0, 3.0, 4.0]], device=DEV)  # a = (-100, 0, 100), b = (2, 3, 4)
    y = silu_and_mul(x, impl="triton")
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, torch.tensor([[0.0, 0.0, 400.0]], device=DEV))
    x3 = torch.randn(2, 3, 34, generator=torch.Generator().manual_seed(0)).to(DEV)
    y3 = silu_and_mul(x3, impl="triton")
    assert y3.shape == (2, 3, 17) and rel_err(y3, exact(x3)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype: torch.dtype) -> None:
    x = torch.randn(4, 600, generator=torch.Generator().manual_seed(1)).to(DEV, dtype)
    y = silu_and_mul(x, impl="triton")
    assert y.dtype == dtype
    assert rel_err(y, exact(x)) < 1e-2
    assert rel_err(y, silu_and_mul_reference(x)) < 1e-2


def test_impls_and_errors() -> None:
    x = torch.randn(3, 8)
    torch.testing.assert_close(silu_and_mul(x), F.silu(x[:, :4]) * x[:, 4:])
    torch.testing.assert_close(silu_and_mul(x, impl="torch"), F.silu(x[:, :4]) * x[:, 4:])
    assert silu_and_mul(torch.empty(0, 8, device=DEV), impl="triton").shape == (0, 4)
    with pytest.raises(ValueError, match="even last dim"):
        silu_and_mul(torch.randn(3, 7), impl="triton")
    with pytest.raises(ValueError, match="unsupported dtype"):
        silu_and_mul(x.int(), impl="triton")
    with pytest.raises(ValueError, match="unknown impl"):
        silu_and_mul(x, impl="vllm")


# ---- GPU tier ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("tokens,d", [(4096, 14336), (7, 1537), (1, 11008)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)])
def test_gpu_matches_reference(tokens: int, d: int, dtype: torch.dtype, tol: float) -> None:
    x = (2 * torch.randn(tokens, 2 * d, device="cuda")).to(dtype)
    torch.empty(tokens, d, dtype=dtype, device="cuda").fill_(float("nan"))  # poison the cache
    y = silu_and_mul(x)
    assert torch.isfinite(y).all()
    assert rel_err(y, exact(x)) < tol
