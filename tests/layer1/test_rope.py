"""apply_rope / rope_cache against HF's rotate_half convention, computed independently here."""
from __future__ import annotations

import math

import pytest
import torch

from layer1_kernels.interpreter import kernel_device
from layer1_kernels.rope import apply_rope, rope_cache, rope_reference

#: Where our kernels run: CUDA on a GPU machine, else the CPU through Triton's interpreter.
DEV = kernel_device()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def hf_style(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """HF's formula written out in float64: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)."""
    c = torch.cat((cos[pos], cos[pos]), -1).double()[:, None, :]
    s = torch.cat((sin[pos], sin[pos]), -1).double()[:, None, :]
    x = x.double()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * c + rotated * s


def make(tokens: int, hq: int, hk: int, d: int, seed: int, dtype=torch.float32, device=None):
    device = DEV if device is None else device
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, hq, d, generator=gen).to(device, dtype)
    k = torch.randn(tokens, hk, d, generator=gen).to(device, dtype)
    return q, k


def test_rope_cache_angles() -> None:
    cos, sin = rope_cache(100, 10, base=500.0)
    assert cos.shape == sin.shape == (100, 5) and cos.dtype == torch.float32
    p, i = 37, 3
    angle = p * 500.0 ** (-2 * i / 10)
    assert math.isclose(cos[p, i].item(), math.cos(angle), abs_tol=1e-5)
    assert math.isclose(sin[p, i].item(), math.sin(angle), abs_tol=1e-5)
    assert torch.equal(cos[0], torch.ones(5)) and torch.equal(sin[0], torch.zeros(5))
    c16, _ = rope_cache(8, 4, dtype=torch.bfloat16)
    assert c16.dtype == torch.bfloat16


@pytest.mark.parametrize("tokens,hq,hk,d", [(7, 4, 2, 64), (5, 3, 1, 80), (1, 1, 1, 2), (9, 6, 6, 34)])
def test_kernel_matches_hf_formula(tokens: int, hq: int, hk: int, d: int) -> None:
    q, k = make(tokens, hq, hk, d, seed=d)
    cos, sin = rope_cache(64, d, device=DEV)
    pos = torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(tokens)).to(DEV)
    q_hf, k_hf = hf_style(q, cos, sin, pos), hf_style(k, cos, sin, pos)
    q_ref, k_ref = rope_reference(q, k, cos, sin, pos)
    assert rel_err(q_ref, q_hf) < 1e-6 and rel_err(k_ref, k_hf) < 1e-6
    q_in, k_in = q.clone(), k.clone()
    q_out, k_out = apply_rope(q_in, k_in, cos, sin, positions=pos, impl="triton")
    assert q_out is q_in and k_out is k_in  # rotated in place
    assert rel_err(q_out, q_hf) < 1e-6 and rel_err(k_out, k_hf) < 1e-6
    # A rotation keeps the length of every (x1[i], x2[i]) pair.
    torch.testing.assert_close(q_out.norm(dim=-1), q.norm(dim=-1))


def test_default_positions_and_torch_impl_in_place() -> None:
    q, k = make(6, 2, 1, 16, seed=1)
    cos, sin = rope_cache(6, 16, device=DEV)
    q_ref, k_ref = rope_reference(q, k, cos, sin, torch.arange(6, device=DEV))
    q1, k1 = apply_rope(q.clone(), k.clone(), cos, sin, impl="triton")
    q2, k2 = q.clone(), k.clone()
    apply_rope(q2, k2, cos, sin, impl="torch")
    for out, ref in ((q1, q_ref), (k1, k_ref), (q2, q_ref), (k2, k_ref)):
        assert rel_err(out, ref) < 1e-6
    torch.testing.assert_close(q1[0], q[0])  # position 0 is the identity rotation


def test_strided_views_of_a_fused_qkv() -> None:
    tokens, hq, hk, d = 5, 4, 2, 32
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=torch.Generator().manual_seed(2)).to(DEV)
    original = qkv.clone()
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
    cos, sin = rope_cache(16, d, device=DEV)
    pos = torch.tensor([3, 1, 4, 1, 5], device=DEV)
    q_ref, k_ref = rope_reference(q, k, cos, sin, pos)
    apply_rope(q, k, cos, sin, positions=pos, impl="triton")
    assert rel_err(qkv[:, : hq * d].view(tokens, hq, d), q_ref) < 1e-6
    assert rel_err(qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d), k_ref) < 1e-6
    assert torch.equal(qkv[:, (hq + hk) * d :], original[:, (hq + hk) * d :])  # v untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype: torch.dtype) -> None:
    q, k = make(8, 4, 2, 64, seed=3, dtype=dtype)
    cos, sin = rope_cache(8, 64, device=DEV)
    q_ref = hf_style(q, cos, sin, torch.arange(8, device=DEV))
    q_out, _ = apply_rope(q.clone(), k.clone(), cos, sin, impl="triton")
    assert q_out.dtype == dtype and rel_err(q_out, q_ref) < 1e-2


def test_matches_transformers_apply_rotary_pos_emb() -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    tokens, hq, hk, d = 6, 4, 2, 64
    q, k = make(tokens, hq, hk, d, seed=4)
    cos, sin = rope_cache(32, d, device=DEV)
    pos = torch.tensor([0, 5, 9, 10, 11, 31], device=DEV)
    c_full = torch.cat((cos[pos], cos[pos]), -1)[None]  # (batch=1, seq, D), as HF builds it
    s_full = torch.cat((sin[pos], sin[pos]), -1)[None]
    # HF layout: (batch, heads, seq, D); ours: (seq, heads, D).
    q_hf, k_hf = llama.apply_rotary_pos_emb(q.permute(1, 0, 2)[None], k.permute(1, 0, 2)[None], c_full, s_full)
    q_out, k_out = apply_rope(q.clone(), k.clone(), cos, sin, positions=pos, impl="triton")
    assert rel_err(q_out, q_hf[0].permute(1, 0, 2)) < 1e-6
    assert rel_err(k_out, k_hf[0].permute(1, 0, 2)) < 1e-6


def test_bad_inputs_raise() -> None:
    q, k = make(4, 2, 1, 8, seed=0, device="cpu")
    cos, sin = rope_cache(4, 8)
    with pytest.raises(ValueError, match="even"):
        rope_cache(4, 7)
    with pytest.raises(ValueError, match="cos and sin must both be"):
        apply_rope(q, k, cos[:, :3], sin[:, :3], impl="triton")
    with pytest.raises(ValueError, match="positions must lie in"):
        apply_rope(q, k, cos, sin, positions=torch.tensor([0, 1, 2, 4]), impl="triton")
    with pytest.raises(ValueError, match="share a dtype"):
        apply_rope(q, k.double(), cos, sin, impl="triton")
    with pytest.raises(ValueError, match="tokens, heads, head_dim"):
        apply_rope(q[0], k, cos, sin, impl="triton")
    with pytest.raises(ValueError, match="unknown impl"):
        apply_rope(q, k, cos, sin, impl="flash")


# ---- GPU tier ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("hq,hk,d", [(32, 8, 128), (12, 12, 80), (64, 8, 64)])
def test_gpu_matches_reference(dtype: torch.dtype, tol: float, hq: int, hk: int, d: int) -> None:
    tokens = 4096
    q = torch.randn(tokens, hq, d, device="cuda").to(dtype)
    k = torch.randn(tokens, hk, d, device="cuda").to(dtype)
    cos, sin = rope_cache(8192, d, device="cuda")
    pos = torch.randint(0, 8192, (tokens,), device="cuda")
    q_ref, k_ref = hf_style(q, cos, sin, pos), hf_style(k, cos, sin, pos)
    apply_rope(q, k, cos, sin, positions=pos)
    assert rel_err(q, q_ref) < tol and rel_err(k, k_ref) < tol
