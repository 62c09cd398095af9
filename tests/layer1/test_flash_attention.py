"""flash_attention: our FlashAttention-2 forward (interpreted on CPU) against math attention."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from layer1_kernels.flash_attention import (
    flash_attention,
    flash_attention_reference,
    flash_attention_tokens,
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def qkv(b: int, hq: int, hkv: int, nq: int, nk: int, d: int, seed: int, device: str = "cpu",
        dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, d))
    return tuple(torch.randn(*s, generator=gen, device=device).to(dtype) for s in shapes)


def exact(q, k, v, causal: bool, scale: float | None = None) -> torch.Tensor:
    return flash_attention_reference(q.double(), k.double(), v.double(), causal=causal, scale=scale)


# --- the reference itself, against torch's SDPA (top-left causal == bottom-right when Nq == Nk)

@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_sdpa(causal: bool) -> None:
    q, k, v = qkv(2, 4, 2, 19, 19, 16, seed=1)
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    sdpa = F.scaled_dot_product_attention(q.double(), kr.double(), vr.double(), is_causal=causal)
    assert rel_err(flash_attention_reference(q, k, v, causal=causal), sdpa) < 1e-6


def test_reference_causal_is_bottom_right() -> None:
    q, k, v = qkv(1, 2, 2, 3, 8, 16, seed=2)
    out = exact(q, k, v, causal=True)
    # query i sees keys j <= i + 5: the last query sees them all, the first sees 6 of 8
    assert rel_err(out[:, :, -1:], exact(q[:, :, -1:], k, v, causal=False)) < 1e-12
    assert rel_err(out[:, :, :1], exact(q[:, :, :1], k[:, :, :6], v[:, :, :6], causal=False)) < 1e-12


# --- our kernel on CPU, through Triton's interpreter ------------------------------------

@pytest.mark.parametrize("b,hq,hkv,nq,nk,d", [
    (1, 4, 2, 37, 37, 64),   # ragged tails, GQA 2:1
    (2, 4, 2, 5, 70, 64),    # short queries against a longer KV prefix
    (1, 2, 2, 1, 33, 16),    # decode: one query
    (1, 4, 1, 20, 48, 32),   # MQA, Nk a multiple of the block
])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.interpreter
def test_matches_float64(b: int, hq: int, hkv: int, nq: int, nk: int, d: int, causal: bool) -> None:
    q, k, v = qkv(b, hq, hkv, nq, nk, d, seed=nq * 100 + nk)
    out = flash_attention(q, k, v, causal=causal, impl="triton")
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, exact(q, k, v, causal)) < 1e-5


@pytest.mark.interpreter
def test_causal_queries_without_keys_output_zero() -> None:
    q, k, v = qkv(1, 2, 1, 40, 7, 32, seed=3)  # Nq > Nk: the first 33 queries see no key
    out = flash_attention(q, k, v, causal=True, impl="triton")
    ref = exact(q, k, v, causal=True)
    assert torch.isfinite(out).all()
    assert (out[:, :, :33] == 0).all() and (ref[:, :, :33] == 0).all()
    assert rel_err(out, ref) < 1e-5


@pytest.mark.interpreter
def test_custom_scale_and_strided_layout() -> None:
    # (B, N, H, D) storage viewed as (B, H, N, D): read in place through the strides
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 21, 4, 32, generator=gen).transpose(1, 2)
    k = torch.randn(2, 30, 2, 32, generator=gen).transpose(1, 2)
    v = torch.randn(2, 30, 2, 32, generator=gen).transpose(1, 2)
    assert not q.is_contiguous()
    out = flash_attention(q, k, v, causal=True, scale=0.3, impl="triton")
    assert rel_err(out, exact(q, k, v, True, scale=0.3)) < 1e-5


def test_auto_on_cpu_is_the_reference() -> None:
    q, k, v = qkv(1, 2, 1, 9, 9, 16, seed=5)
    assert rel_err(flash_attention(q, k, v, causal=True), exact(q, k, v, True)) < 1e-6
    assert rel_err(flash_attention(q, k, v, impl="torch"), exact(q, k, v, False)) < 1e-6


@pytest.mark.interpreter
def test_bad_inputs_raise() -> None:
    q, k, v = qkv(1, 4, 2, 8, 8, 16, seed=6)
    with pytest.raises(ValueError, match="unknown impl"):
        flash_attention(q, k, v, impl="flash")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention(q[:, :3], k, v, impl="triton")
    with pytest.raises(ValueError, match="4-D"):
        flash_attention(q[0], k, v)
    with pytest.raises(ValueError, match="shapes differ"):
        flash_attention(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="dtypes differ"):
        flash_attention(q, k.half(), v, impl="triton")
    with pytest.raises(ValueError, match="head dim 48"):
        flash_attention(*qkv(1, 2, 2, 8, 8, 48, seed=7), impl="triton")
    with pytest.raises(ValueError, match="no keys"):
        flash_attention(q, k[:, :, :0], v[:, :, :0])
    with pytest.raises(ValueError, match="scale must be positive"):
        flash_attention(q, k, v, scale=-1.0, impl="triton")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="bf16"):
            flash_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), impl="triton")


# --- the token-major entry (one sequence, strided rows of a fused qkv, as the model holds it)

def fused_rows(hq: int, hkv: int, nq: int, nk: int, d: int, seed: int, device: str = "cpu",
               dtype: torch.dtype = torch.float32):
    """q (nq, hq, d) and k, v (nk, hkv, d) as strided views into fused qkv-like rows (the
    queries are the last nq positions), and an output buffer with gaps between its rows."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = torch.randn(nk, (hq + 2 * hkv) * d, generator=gen, device=device).to(dtype)
    q = rows[nk - nq:, :hq * d].view(nq, hq, d)
    k = rows[:, hq * d:(hq + hkv) * d].view(nk, hkv, d)
    v = rows[:, (hq + hkv) * d:].view(nk, hkv, d)
    out = torch.full((nq, hq, 2 * d), float("nan"), device=device, dtype=dtype)[..., :d]
    return q, k, v, out


def four_d(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1)[None]


@pytest.mark.parametrize("hq,hkv,nq,nk,d", [(4, 2, 37, 37, 64), (4, 1, 5, 70, 32),
                                            (2, 2, 1, 33, 16)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.interpreter
def test_tokens_entry_matches_float64(hq, hkv, nq, nk, d, causal) -> None:
    q, k, v, out = fused_rows(hq, hkv, nq, nk, d, seed=nq + nk)
    got = flash_attention_tokens(q, k, v, out, causal=causal, impl="triton")
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(out).all()
    ref = exact(four_d(q), four_d(k), four_d(v), causal)[0].transpose(0, 1)
    assert rel_err(out, ref) < 1e-5
    # the torch impl and the 4-D entry give the same numbers
    alt = torch.empty_like(q)
    flash_attention_tokens(q, k, v, alt, causal=causal, impl="torch")
    assert rel_err(alt, ref) < 1e-5
    four = flash_attention(four_d(q), four_d(k), four_d(v), causal=causal, impl="triton")
    assert torch.equal(four[0].transpose(0, 1), out)


@pytest.mark.interpreter
def test_tokens_entry_bad_inputs_raise() -> None:
    q, k, v, out = fused_rows(4, 2, 8, 8, 16, seed=3)
    with pytest.raises(ValueError, match="3-D"):
        flash_attention_tokens(four_d(q), k, v, out)
    with pytest.raises(ValueError, match="out must match q"):
        flash_attention_tokens(q, k, v, out[:4])
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention_tokens(q[:, :3], k, v, out[:, :3])
    with pytest.raises(ValueError, match="shapes differ"):
        flash_attention_tokens(q, k, v[:4], out)
    with pytest.raises(ValueError, match="no keys"):
        flash_attention_tokens(q, k[:0], v[:0], out)
    with pytest.raises(ValueError, match="dtypes differ"):
        flash_attention_tokens(q, k.half(), v, out, impl="triton")
    with pytest.raises(ValueError, match="scale must be positive"):
        flash_attention_tokens(q, k, v, out, scale=0.0, impl="triton")


# --- GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,nq,nk,d", [(32, 8, 2048, 2048, 64), (8, 2, 1000, 1000, 128),
                                            (8, 4, 77, 1300, 64)])
def test_gpu_tokens_entry_matches_4d(hq, hkv, nq, nk, d) -> None:
    """The model's layout (strided fused-qkv rows) gives the 4-D entry's numbers, bf16."""
    q, k, v, out = fused_rows(hq, hkv, nq, nk, d, seed=d, device="cuda", dtype=torch.bfloat16)
    flash_attention_tokens(q, k, v, out, causal=True)
    four = flash_attention(four_d(q), four_d(k), four_d(v), causal=True)
    assert torch.equal(four[0].transpose(0, 1), out)
    ref = flash_attention_reference(four_d(q), four_d(k), four_d(v), causal=True)
    assert rel_err(out, ref[0].transpose(0, 1).float()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,hq,hkv,nq,nk,d", [
    (2, 8, 8, 1000, 1000, 128),   # ragged N
    (2, 8, 2, 1000, 1000, 64),    # GQA 4:1
    (1, 32, 8, 1024, 1024, 128),  # Llama-3-8B-like heads
    (4, 8, 2, 1, 1000, 128),      # decode against a KV cache
    (1, 8, 4, 77, 1300, 64),      # chunked prefill against a prefix
])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_matches_reference(dtype, b, hq, hkv, nq, nk, d, causal) -> None:
    q, k, v = qkv(b, hq, hkv, nq, nk, d, seed=nq + nk + d, device="cuda", dtype=dtype)
    torch.full((b, hq, nq, d), float("nan"), dtype=dtype, device="cuda")  # poison the allocator
    out = flash_attention(q, k, v, causal=causal)
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref = flash_attention_reference(q, k, v, causal=causal).float()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("d", [16, 32])
def test_gpu_small_head_dims_and_fp32(d: int) -> None:
    q, k, v = qkv(2, 4, 2, 300, 300, d, seed=d, device="cuda")
    out = flash_attention(q, k, v, causal=True)  # fp32 runs tf32 dots
    assert rel_err(out, flash_attention_reference(q, k, v, causal=True)) < 5e-3


@pytest.mark.gpu
def test_gpu_agrees_with_sdpa_flash() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = qkv(2, 16, 16, 2048, 2048, 128, seed=9, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(128))
    assert rel_err(flash_attention(q, k, v, causal=True), ref) < 1e-2
