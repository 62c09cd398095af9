"""int8_matmul (W8A16) and quantize_int8: our Triton kernel (interpreted on CPU) against torch."""
from __future__ import annotations

import pytest
import torch

from layer1_kernels.int8_matmul import int8_matmul, int8_matmul_reference, quantize_int8


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def randn(*shape: int, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


def exact(x: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.double() @ (w_int8.double() * scale.double()[:, None]).T


# --- quantize_int8 ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_round_trip(dtype: torch.dtype) -> None:
    w = randn(77, 100, seed=1, dtype=dtype)
    w[5] = 0  # an all-zero row must not divide by zero
    w_int8, scale = quantize_int8(w)
    assert w_int8.dtype == torch.int8 and w_int8.shape == (77, 100)
    assert scale.dtype == dtype and scale.shape == (77,)
    assert w_int8.abs().max() <= 127 and (w_int8[5] == 0).all() and scale[5] == 1
    err = (w_int8.double() * scale.double()[:, None] - w.double()).abs()
    assert (err <= scale.double()[:, None] / 2 * (1 + 1e-6)).all()  # half a step at most
    assert (w_int8.abs().amax(dim=1)[torch.arange(77) != 5] >= 126).all()  # the range is used


def test_quantize_rejects_non_float_or_non_2d() -> None:
    with pytest.raises(ValueError, match="2-D float"):
        quantize_int8(torch.ones(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="2-D float"):
        quantize_int8(torch.ones(4, 4, dtype=torch.int32))


# --- our kernel on CPU, through Triton's interpreter ------------------------------------

@pytest.mark.parametrize("m,k,n", [(3, 100, 77), (1, 17, 1), (20, 64, 33), (16, 40, 50)])
@pytest.mark.interpreter
def test_matches_float64(m: int, k: int, n: int) -> None:
    x = randn(m, k, seed=m)
    w_int8, scale = quantize_int8(randn(n, k, seed=n + 1))
    out = int8_matmul(x, w_int8, scale, impl="triton")
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert rel_err(out, exact(x, w_int8, scale)) < 1e-5


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.interpreter
def test_half_precision_scales(scale_dtype: torch.dtype) -> None:
    x = randn(5, 48, seed=2)
    w_int8, scale = quantize_int8(randn(24, 48, seed=3, dtype=scale_dtype))
    assert rel_err(int8_matmul(x, w_int8, scale, impl="triton"), exact(x, w_int8, scale)) < 1e-5


@pytest.mark.interpreter
def test_float16_activations_and_strided_x() -> None:
    x = randn(40, 6, seed=4, dtype=torch.float16).T  # (6, 40), not contiguous
    w_int8, scale = quantize_int8(randn(30, 40, seed=5))
    out = int8_matmul(x, w_int8, scale, impl="triton")
    assert out.dtype == torch.float16
    assert rel_err(out, exact(x, w_int8, scale)) < 2e-3


@pytest.mark.interpreter
def test_close_to_the_unquantized_matmul() -> None:
    x, w = randn(4, 256, seed=6), randn(64, 256, seed=7)
    out = int8_matmul(x, *quantize_int8(w), impl="triton")
    assert rel_err(out, x.double() @ w.double().T) < 1e-2  # int8 rounding: ~0.5% here


def test_auto_on_cpu_is_the_reference() -> None:
    x = randn(3, 20, seed=8)
    w_int8, scale = quantize_int8(randn(10, 20, seed=9))
    assert rel_err(int8_matmul(x, w_int8, scale), exact(x, w_int8, scale)) < 1e-6
    assert rel_err(int8_matmul_reference(x, w_int8, scale), exact(x, w_int8, scale)) < 1e-6


@pytest.mark.interpreter
def test_bad_inputs_raise() -> None:
    x = torch.ones(3, 20)
    w_int8, scale = quantize_int8(torch.ones(10, 20))
    with pytest.raises(ValueError, match="unknown impl"):
        int8_matmul(x, w_int8, scale, impl="cublas")
    with pytest.raises(ValueError, match="K=20 but w_int8 has K=10"):
        int8_matmul(x, w_int8.T.contiguous(), scale, impl="triton")
    with pytest.raises(ValueError, match="scale has 9 entries"):
        int8_matmul(x, w_int8, scale[:9], impl="triton")
    with pytest.raises(ValueError, match="must be torch.int8"):
        int8_matmul(x, w_int8.float(), scale)
    with pytest.raises(ValueError, match="activation dtype"):
        int8_matmul(x.int(), w_int8, scale, impl="triton")
    with pytest.raises(ValueError, match="x \\(M, K\\)"):
        int8_matmul(x[0], w_int8, scale)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="bf16"):
            int8_matmul(x.bfloat16(), w_int8, scale, impl="triton")


# --- GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,n", [(1, 4096, 4096), (3, 4096, 4096), (16, 4096, 11008),
                                   (100, 1000, 1537), (512, 4096, 4096)])
def test_gpu_matches_reference(dtype: torch.dtype, m: int, k: int, n: int) -> None:
    x = randn(m, k, seed=m, device="cuda", dtype=dtype)
    w_int8, scale = quantize_int8(randn(n, k, seed=n, device="cuda", dtype=dtype))
    torch.full((m, n), float("nan"), dtype=dtype, device="cuda")  # poison the allocator
    out = int8_matmul(x, w_int8, scale)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, exact(x, w_int8, scale)) < 1e-2
