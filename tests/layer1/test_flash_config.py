"""flash_attention's launch configs: a caller's config is checked, and every config the tile
table picks (and the tuning sweep's candidates) computes the same function at awkward sizes,
in the serving path's strided layout (q a view of a fused qkv row, k/v views of (T, H, D))."""
from __future__ import annotations

import importlib

import pytest
import torch

# the module, not the function layer1_kernels re-exports under the same name
fa = importlib.import_module("layer1_kernels.flash_attention")



def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def strided_qkv(t: int, hq: int, hkv: int, d: int, seed: int, device: str,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (1, Hq, T, D) viewed from a fused (T, (Hq + 2 Hkv) D) row; k, v (1, Hkv, T, D) from
    (1, T, Hkv, D): the layout layer 3's prefill hands the kernel."""
    gen = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen, device=device).to(dtype)
    q = qkv[:, :hq * d].view(t, hq, d).transpose(0, 1)[None]
    k = qkv[:, hq * d:(hq + hkv) * d].view(1, t, hkv, d).transpose(1, 2)
    v = qkv[:, (hq + hkv) * d:].view(1, t, hkv, d).transpose(1, 2)
    return q, k, v


@pytest.mark.parametrize("bad,msg", [
    ({"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}, "exactly the keys"),
    ({"BLOCK_M": 48, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}, "power of two"),
    ({"BLOCK_M": 64, "BLOCK_N": 8, "num_warps": 4, "num_stages": 2}, "power of two >= 16"),
    ({"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 0, "num_stages": 2}, "positive int"),
])
def test_bad_config_is_named(bad: dict, msg: str) -> None:
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=msg):
        fa.flash_attention(q, q, q, causal=True, impl="triton" if fa.interpreter.INTERPRETED
                           else "auto", config=bad)


@pytest.mark.interpreter
@pytest.mark.parametrize("t", [37, 70])
@pytest.mark.parametrize("cfg", [(32, 16), (16, 32)])
def test_interpreted_config_matches_float64(t: int, cfg: tuple[int, int]) -> None:
    q, k, v = strided_qkv(t, 4, 2, 16, seed=t, device="cpu", dtype=torch.float32)
    config = {"BLOCK_M": cfg[0], "BLOCK_N": cfg[1], "num_warps": 1, "num_stages": 1}
    out = fa.flash_attention(q, k, v, causal=True, impl="triton", config=config)
    ref = fa.flash_attention_reference(q.double(), k.double(), v.double(), causal=True)
    assert rel_err(out, ref) < 1e-5


def _table_configs() -> list[dict]:
    """Every distinct config the table picks for bf16 (prefill and decode lengths, D, causal)."""
    seen = []
    for nq in (1, 64, 65, 512, 2048, 8192):
        for d in (16, 32, 64, 128):
            for causal in (False, True):
                cfg = fa._pick_config(nq, d, torch.bfloat16, causal)
                if cfg not in seen:
                    seen.append(cfg)
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 37, 333, 2049])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_every_table_config_strided(t: int, d: int) -> None:
    q, k, v = strided_qkv(t, 8, 2, d, seed=t + d, device="cuda", dtype=torch.bfloat16)
    ref = fa.flash_attention_reference(q.double(), k.double(), v.double(), causal=True)
    for cfg in _table_configs():
        torch.full((1, 8, t, d), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison
        out = fa.flash_attention(q, k, v, causal=True, config=cfg)
        assert torch.isfinite(out).all(), cfg
        assert rel_err(out, ref) < 1e-2, cfg


# --- the HEADS_FIRST grid order: the same programs launched in another order ------------

def test_heads_first_config_is_checked() -> None:
    q = torch.randn(1, 2, 8, 16)
    impl = "triton" if fa.interpreter.INTERPRETED else "auto"
    base = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    with pytest.raises(ValueError, match="HEADS_FIRST"):
        fa.flash_attention(q, q, q, causal=True, impl=impl, config={**base, "HEADS_FIRST": 1})
    with pytest.raises(ValueError, match="exactly the keys"):
        fa.flash_attention(q, q, q, causal=True, impl=impl, config={**base, "ORDER": "heads"})


def test_table_orders_causal_launches_by_the_switch(monkeypatch) -> None:
    """CAUSAL_HEADS_FIRST (on unless LLM_STACK_FLASH_HEADS_FIRST=0) orders causal launches
    only (a non-causal launch's programs do equal work), and only while the query blocks fit
    CUDA's grid axis 1 (past it the default order: no launch error)."""
    monkeypatch.setattr(fa, "CAUSAL_HEADS_FIRST", False)
    for nq in (1, 2048):
        assert fa._pick_config(nq, 64, torch.bfloat16, True)["HEADS_FIRST"] is False
    monkeypatch.setattr(fa, "CAUSAL_HEADS_FIRST", True)
    assert fa._pick_config(2048, 64, torch.bfloat16, True)["HEADS_FIRST"] is True
    assert fa._pick_config(2048, 64, torch.bfloat16, False)["HEADS_FIRST"] is False
    huge = (fa._MAX_GRID_Y + 1) * 128
    assert fa._pick_config(huge, 64, torch.bfloat16, True)["HEADS_FIRST"] is False


def test_heads_first_is_the_default() -> None:
    """The measured-faster order is what a plain import gets (the env switch unset in CI)."""
    import os
    if "LLM_STACK_FLASH_HEADS_FIRST" not in os.environ:
        assert fa.CAUSAL_HEADS_FIRST is True


@pytest.mark.interpreter
@pytest.mark.parametrize("t,hq,hkv", [(37, 4, 2), (70, 3, 1), (16, 2, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_interpreted_heads_first_equals_default_order(t: int, hq: int, hkv: int,
                                                      causal: bool) -> None:
    """Ragged tails, GQA and MQA, in the serving layout through both entries: each program
    does the same arithmetic in either order, so the outputs are equal bit for bit (and the
    reference's numbers)."""
    q, k, v = strided_qkv(t, hq, hkv, 16, seed=t + hq, device="cpu", dtype=torch.float32)
    base = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    first = fa.flash_attention(q, k, v, causal=causal, impl="triton",
                               config={**base, "HEADS_FIRST": True})
    default = fa.flash_attention(q, k, v, causal=causal, impl="triton", config=base)
    assert torch.equal(first, default)
    ref = fa.flash_attention_reference(q.double(), k.double(), v.double(), causal=causal)
    assert rel_err(first, ref) < 1e-5
    tok = [x[0].transpose(0, 1) for x in (q, k, v)]
    out = torch.full_like(tok[0], float("nan"))
    fa.flash_attention_tokens(*tok, out, causal=causal, impl="triton",
                              config={**base, "HEADS_FIRST": True})
    assert torch.equal(out, default[0].transpose(0, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [333, 2048])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_heads_first_equals_default_order(t: int, d: int) -> None:
    """The table's tiles in the HEADS_FIRST order: the default order's output bit for bit, the
    lone prompt's shape (32 q / 8 kv heads) in the serving layout."""
    q, k, v = strided_qkv(t, 32, 8, d, seed=t + d, device="cuda", dtype=torch.bfloat16)
    cfg = fa._pick_config(t, d, torch.bfloat16, True)
    default = fa.flash_attention(q, k, v, causal=True, config={**cfg, "HEADS_FIRST": False})
    first = fa.flash_attention(q, k, v, causal=True, config={**cfg, "HEADS_FIRST": True})
    assert torch.equal(first, default)
    ref = fa.flash_attention_reference(q, k, v, causal=True)
    assert rel_err(first, ref.float()) < 1e-2
