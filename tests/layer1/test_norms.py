"""rms_norm and layer_norm (with and without the fused residual add) against torch references."""
from __future__ import annotations

import pytest
import torch

from layer1_kernels.interpreter import kernel_device
from layer1_kernels.norms import (
    MAX_FUSED_COLS,
    _norm_triton,
    layer_norm,
    layer_norm_reference,
    rms_norm,
    rms_norm_reference,
)

#: Where our kernels run: CUDA on a GPU machine, else the CPU through Triton's interpreter.
DEV = kernel_device()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, or the absolute error where ref is all zeros."""
    diff = (out.double() - ref.double()).norm()
    scale = ref.double().norm()
    return (diff / scale if scale > 0 else diff).item()


def inputs(rows: int, hidden: int, seed: int, dtype=torch.float32, offset: float = 0.0, device=None):
    device = DEV if device is None else device
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=gen) + offset).to(device, dtype)
    r = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    w = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(device, dtype)
    b = torch.randn(hidden, generator=gen).to(device, dtype)
    return x, r, w, b


@pytest.mark.parametrize("hidden", [1, 17, 1000, 1537])
def test_rms_norm_matches_float64(hidden: int) -> None:
    x, _, w, _ = inputs(6, hidden, seed=hidden)
    y = rms_norm(x, w, eps=1e-6, impl="triton")
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, rms_norm_reference(x.double(), w.double(), eps=1e-6)) < 1e-5


@pytest.mark.parametrize("hidden", [17, 1000, 1537])
@pytest.mark.parametrize("max_block", [MAX_FUSED_COLS, 256])
def test_rms_norm_with_residual(hidden: int, max_block: int) -> None:
    x, r, w, _ = inputs(5, hidden, seed=hidden + 1)
    # max_block < hidden forces the two-pass chunked kernel.
    y, h = _norm_triton(x, w, None, 1e-6, r, is_rms=True, max_block=max_block)
    assert torch.equal(h, x + r)  # the new residual stream is written exactly
    y_ref, _ = rms_norm_reference(x.double(), w.double(), eps=1e-6, residual=r.double())
    assert rel_err(y, y_ref) < 1e-5
    y2, h2 = rms_norm(x, w, eps=1e-6, residual=r, impl="triton")
    assert torch.equal(h2, h) and rel_err(y2, y_ref) < 1e-5


@pytest.mark.parametrize("hidden", [1, 17, 1000, 1537])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_matches_float64(hidden: int, with_bias: bool) -> None:
    x, _, w, b = inputs(6, hidden, seed=hidden + 2, offset=5.0)
    b = b if with_bias else None
    y = layer_norm(x, w, b, eps=1e-5, impl="triton")
    ref = layer_norm_reference(x.double(), w.double(), None if b is None else b.double(), eps=1e-5)
    assert rel_err(y, ref) < 1e-5


@pytest.mark.parametrize("hidden,max_block", [(1000, 128), (1537, 256), (300, 100)])
def test_layer_norm_chunked_with_residual(hidden: int, max_block: int) -> None:
    # A large common offset: the chunked variance must not cancel catastrophically.
    x, r, w, b = inputs(4, hidden, seed=hidden + 3, offset=100.0)
    y, h = _norm_triton(x, w, b, 1e-5, r, is_rms=False, max_block=max_block)
    assert torch.equal(h, x + r)
    y_ref = layer_norm_reference(h.double(), w.double(), b.double(), eps=1e-5)
    assert rel_err(y, y_ref) < 1e-5


def test_leading_dims_and_empty() -> None:
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(2, 3, 40, generator=gen).to(DEV), torch.randn(40, generator=gen).to(DEV)
    y = rms_norm(x, w, impl="triton")
    assert y.shape == (2, 3, 40)
    assert rel_err(y, rms_norm_reference(x.double(), w.double())) < 1e-5
    assert rms_norm(torch.empty(0, 40, device=DEV), w, impl="triton").shape == (0, 40)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_with_residual(dtype: torch.dtype) -> None:
    x, r, w, b = inputs(4, 300, seed=4, dtype=dtype)
    y, h = rms_norm(x, w, residual=r, impl="triton")
    y_ref, h_ref = rms_norm_reference(x, w, residual=r)
    assert y.dtype == h.dtype == dtype
    # The interpreter rounds fp32 -> bf16 toward zero (GPUs round to nearest), so allow an ulp.
    torch.testing.assert_close(h, h_ref)
    assert rel_err(y, y_ref) < 1e-2
    y, h = layer_norm(x, w, b, residual=r, impl="triton")
    assert rel_err(y, layer_norm_reference(x, w, b, residual=r)[0]) < 1e-2


def test_auto_on_cpu_is_the_reference() -> None:
    x, r, w, b = inputs(3, 8, seed=0, device="cpu")
    torch.testing.assert_close(rms_norm(x, w), rms_norm_reference(x, w))
    torch.testing.assert_close(layer_norm(x, w, b, impl="torch"),
                               torch.nn.functional.layer_norm(x, (8,), w, b, 1e-5))


def test_bad_inputs_raise() -> None:
    x, r, w, b = inputs(3, 8, seed=0, device="cpu")
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, torch.ones(7), impl="triton")
    with pytest.raises(ValueError, match="bias must have shape"):
        layer_norm(x, w, torch.ones(9), impl="triton")
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm(x, w, residual=r[:2], impl="triton")
    with pytest.raises(ValueError, match="unsupported dtype"):
        rms_norm(x.double(), w, impl="triton")
    with pytest.raises(ValueError, match="unknown impl"):
        layer_norm(x, w, impl="apex")


# ---- GPU tier ---------------------------------------------------------------------------

GPU_DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows,hidden", [(4096, 8192), (333, 20000), (1000, 1537)])
@pytest.mark.parametrize("dtype,tol", GPU_DTYPES)
def test_gpu_rms_norm_residual(rows: int, hidden: int, dtype: torch.dtype, tol: float) -> None:
    x = torch.randn(rows, hidden, device="cuda").to(dtype)
    r = torch.randn(rows, hidden, device="cuda").to(dtype)
    w = (1 + 0.5 * torch.randn(hidden, device="cuda")).to(dtype)
    torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))  # poison the cache
    y, h = rms_norm(x, w, residual=r)
    assert torch.equal(h, x + r)  # the GPU rounds like torch: bit-exact
    y_ref, _ = rms_norm_reference(x.double(), w.double(), residual=r.double())
    assert torch.isfinite(y).all() and rel_err(y, y_ref) < tol
    y_hf, _ = rms_norm_reference(x, w, residual=r)  # HF arithmetic in the same dtype
    assert rel_err(y, y_hf) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("rows,hidden", [(4096, 8192), (333, 20000)])
@pytest.mark.parametrize("dtype,tol", GPU_DTYPES)
def test_gpu_layer_norm(rows: int, hidden: int, dtype: torch.dtype, tol: float) -> None:
    x = (torch.randn(rows, hidden, device="cuda") + 3).to(dtype)
    w = (1 + 0.5 * torch.randn(hidden, device="cuda")).to(dtype)
    b = torch.randn(hidden, device="cuda").to(dtype)
    torch.full_like(x, float("nan"))
    y = layer_norm(x, w, b)
    ref = torch.nn.functional.layer_norm(x.double(), (hidden,), w.double(), b.double(), 1e-5)
    assert torch.isfinite(y).all() and rel_err(y, ref) < tol
