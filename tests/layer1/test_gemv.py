"""Layer 1's decode kernels against torch references at small awkward sizes: the skinny GEMV
and its fused prologues (gemv.py), RoPE fused with the cache write (rope_cache.py), and the
split decode attention over a contiguous cache with its in-kernel merge (paged_decode.py).
On a CPU they run through Triton's interpreter (fp32 / fp16: its bf16 casts truncate)."""
from __future__ import annotations

import importlib

import pytest
import torch

from layer1_kernels import (
    argmax,
    gemv,
    gemv_reference,
    gemv_rms_norm,
    gemv_rms_norm_reference,
    gemv_rms_norm_rope,
    gemv_rms_norm_rope_attention,
    gemv_rms_norm_rope_reference,
    gemv_silu_mul,
    gemv_silu_mul_reference,
    paged_decode,
    rope_cache,
    rope_cache_write,
)
from layer1_kernels.interpreter import kernel_device

G = importlib.import_module("layer1_kernels.gemv")  # (the package's `gemv` is the function)
GR = importlib.import_module("layer1_kernels.gemv_rope")

DEV = kernel_device()
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV.type == "cuda" else [torch.float16])


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 37, 50), (3, 20, 64), (8, 9, 33)])
def test_gemv_and_prologues(dtype, m, n, k):
    g = torch.Generator().manual_seed(m * 100 + n)
    x, r = (torch.randn(m, k, generator=g).to(DEV, dtype) for _ in range(2))
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype)
    nw = (1 + 0.3 * torch.randn(k, generator=g)).to(DEV, dtype)
    assert rel(gemv(x, w, b, impl="triton"), gemv_reference(x, w, b)) < tol(dtype)
    y, h = gemv_rms_norm(x, w, nw, 1e-6, r, impl="triton")
    y_ref, h_ref = gemv_rms_norm_reference(x, w, nw, 1e-6, r)
    assert torch.equal(h, h_ref) and rel(y, y_ref) < tol(dtype)  # the residual exactly
    y, h = gemv_rms_norm(x, w, nw, 1e-6, None, b, impl="triton")
    assert h is None and rel(y, gemv_rms_norm_reference(x, w, nw, 1e-6, None, b)[0]) < tol(dtype)
    gu = torch.randn(m, 2 * k, generator=g).to(DEV, dtype)
    assert rel(gemv_silu_mul(gu, w, impl="triton"), gemv_silu_mul_reference(gu, w)) < tol(dtype)


def test_gemv_tiles_and_bad_input():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 70, generator=g).to(DEV), torch.randn(45, 70, generator=g).to(DEV)
    for cfg in [(4, 16, 1), (16, 32, 2), (8, 64, 4), (8, 16, 1, 3)]:  # ragged N and K tiles
        assert rel(gemv(x, w, impl="triton", config=cfg), gemv_reference(x, w)) < 1e-5
    for cfg in [(3, 16, 1), (4, 16, 1, 0), (4, 16)]:
        with pytest.raises(ValueError, match="stage count"):
            gemv(x, w, impl="triton", config=cfg)
    with pytest.raises(ValueError, match="1..8 rows"):
        gemv(torch.randn(9, 70).to(DEV), w)
    with pytest.raises(ValueError, match="K = 70"):
        gemv(x, torch.randn(4, 71).to(DEV))
    with pytest.raises(ValueError, match="norm_weight"):
        gemv_rms_norm(x, w, torch.ones(69).to(DEV), 1e-6)
    with pytest.raises(ValueError, match="2K"):
        gemv_silu_mul(torch.randn(1, 71).to(DEV), w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_cache_write(dtype):
    g = torch.Generator().manual_seed(2)
    T, Hq, Hkv, D, slots = 3, 6, 2, 12, 10
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(DEV, dtype)
    cos, sin = (t.to(DEV) for t in rope_cache(32, D))
    pos = torch.tensor([4, 17, 0], device=DEV)
    slot = torch.tensor([7, 2, 9], device=DEV)
    outs = []
    for impl in ("triton", "torch"):
        buf = qkv.clone()
        q, k, v = (t.view(T, -1, D) for t in buf.split([Hq * D, Hkv * D, Hkv * D], dim=-1))
        kc = torch.full((slots, Hkv, D), 7.0).to(DEV, dtype)
        vc = kc.clone()
        rope_cache_write(q, k, v, cos, sin, pos, kc, vc, slot, impl=impl)
        outs.append((buf, kc, vc))
    (b1, k1, v1), (b2, k2, v2) = outs
    assert rel(b1, b2) < tol(dtype) and rel(k1, k2) < tol(dtype) and torch.equal(v1, v2)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[[7, 2, 9]] = False
    assert (k1[untouched.to(DEV)] == 7).all()
    with pytest.raises(ValueError, match="slots"):
        rope_cache_write(q, k, v, cos, sin, pos, kc, vc, slot[:2])


def _tuned_tiles():
    """Every distinct launch config the kernels pick by shape (gemv's, gemv_rope's)."""
    return sorted(set(G.TUNED.values())), sorted(set(GR.TUNED.values()))


def _rope_heads(n: int) -> tuple[int, int, int]:
    """(q heads, kv heads, head_dim) of a qkv width n, 4 q heads per kv head (Llama's)."""
    d = 128 if n % (6 * 128) == 0 else 64
    return 4 * n // (6 * d), n // (6 * d), d


def _check_projections(cfg, m, n, k, dtype, seed, ops=(0, 1, 2)):
    """gemv (op 0), gemv_rms_norm with a residual (1), gemv_silu_mul (2) against the references
    (on a GPU each op is a compile of its own: the tests below rotate through them)."""
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(m, k, generator=g).to(DEV, dtype) for _ in range(2))
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEV, dtype)
    nw = (1 + 0.3 * torch.randn(k, generator=g)).to(DEV, dtype)
    gu = torch.randn(m, 2 * k, generator=g).to(DEV, dtype)
    if 0 in ops:
        assert rel(gemv(x, w, impl="triton", config=cfg), gemv_reference(x, w)) < tol(dtype), cfg
    if 1 in ops:
        y, h = gemv_rms_norm(x, w, nw, 1e-6, r, impl="triton", config=cfg)
        y_ref, h_ref = gemv_rms_norm_reference(x, w, nw, 1e-6, r)
        assert torch.equal(h, h_ref) and rel(y, y_ref) < tol(dtype), cfg
    if 2 in ops:
        y = gemv_silu_mul(gu, w, impl="triton", config=cfg)
        assert rel(y, gemv_silu_mul_reference(gu, w)) < tol(dtype), cfg


def _check_rope(cfg, n, k, heads, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d = heads
    x, r = (torch.randn(1, k, generator=g).to(DEV, dtype) for _ in range(2))
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEV, dtype)
    nw = (1 + 0.3 * torch.randn(k, generator=g)).to(DEV, dtype)
    cos, sin = (t.to(DEV) for t in rope_cache(64, d))
    pos, slot = torch.tensor([37], device=DEV), torch.tensor([3], device=DEV)
    kc, vc, kc2, vc2 = (torch.zeros(5, hkv, d, device=DEV, dtype=dtype) for _ in range(4))
    y, h = gemv_rms_norm_rope(x, w, nw, 1e-6, r, None, cos, sin, pos, kc, vc, slot, hq, hkv, d,
                              impl="triton", config=cfg)
    y2, h2 = gemv_rms_norm_rope_reference(x, w, nw, 1e-6, r, None, cos, sin, pos, kc2, vc2,
                                          slot, hq, hkv, d)
    assert torch.equal(h, h2), cfg
    assert rel(y, y2) < tol(dtype) and rel(kc, kc2) < tol(dtype) and rel(vc, vc2) < tol(dtype), cfg


def test_tuned_tiles_at_awkward_sizes():
    """Each tile the kernels choose by shape, at sizes it does not divide: N not a multiple
    of BLOCK_N, K not a multiple of BLOCK_K (a masked last step; test_tuned_shapes_gpu runs
    the tables' own shapes, most of them EVEN_K)."""
    dtype = DTYPES[-1]
    gemv_tiles, rope_tiles = _tuned_tiles()
    for i, cfg in enumerate(gemv_tiles):
        ops = (0, 1, 2) if DEV.type == "cpu" else (i % 3,)
        _check_projections(cfg, 1, 2 * cfg[0] + 1, cfg[1] + 40, dtype, i, ops)
    for i, cfg in enumerate(rope_tiles):  # pair tiles straddling heads (half = 12)
        _check_rope(cfg, (4 + 2 * 1) * 24, cfg[1] + 40, (4, 1, 24), dtype, 200 + i)


@pytest.mark.parametrize("m", [1, 3])
def test_two_weight_tiles_before_the_wait(m, monkeypatch):
    """pre_tiles 2 (a program requests its second K tile before the PDL wait, then the loop
    starts at the third): the same results, at K with two tiles and a ragged second one, three
    with a ragged last one, exactly one tile (no second to take), and a pipelined loop."""
    monkeypatch.setitem(G._PDL, "pre_tiles", 2)
    dtype = DTYPES[-1]
    for i, (cfg, k) in enumerate([((4, 16, 1), 20), ((4, 16, 1), 33), ((8, 16, 2), 16),
                                  ((2, 16, 1, 3), 64)]):
        _check_projections(cfg, m, 2 * cfg[0] + 3, k, dtype, 300 + i)
    _check_rope((2, 16, 1), (4 + 2 * 1) * 12, 40, (4, 1, 12), dtype, 310)
    _check_rope(None, (4 + 2 * 1) * 12, 16, (4, 1, 12), dtype, 311)
    with pytest.raises(ValueError, match="pre_tiles"):
        G.set_pdl(True, pre_tiles=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3])
def test_late_norm_matches_the_references(dtype, m, monkeypatch):
    """set_norm_late (the norm's statistics gathered in the K loop, 1 / rms on the finished
    product): within rounding of the references, the residual exact, at ragged K, a pipelined
    loop, two tiles before the wait; gemv_rope's the same rows as gemv_rms_norm then
    rope_cache_write."""
    monkeypatch.setitem(G._NORM, "late", True)
    for i, (cfg, k) in enumerate([((4, 16, 1), 33), ((8, 32, 2), 20), ((2, 16, 1, 3), 64)]):
        _check_projections(cfg, m, 2 * cfg[0] + 3, k, dtype, 400 + i, ops=(1,))
    monkeypatch.setitem(G._PDL, "pre_tiles", 2)
    _check_projections((4, 16, 1), m, 11, 40, dtype, 410, ops=(1,))
    _check_rope((2, 16, 1), (4 + 2 * 1) * 12, 40, (4, 1, 12), dtype, 411)
    test_gemv_rms_norm_rope_matches_unfused(dtype, m, 4, 1, 16, 33, None)


def _attention_case(m, hq, hkv, d, k, lens, paged, dtype, seed):
    """Inputs of gemv_rms_norm_rope_attention: a cache holding older keys, each row's new
    token at position lens[m] - 1 (written by the call)."""
    g = torch.Generator().manual_seed(seed)
    n = (hq + 2 * hkv) * d
    x, r = (torch.randn(m, k, generator=g).to(DEV, dtype) for _ in range(2))
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEV, dtype)
    nw = (1 + 0.3 * torch.randn(k, generator=g)).to(DEV, dtype)
    cos, sin = (t.to(DEV) for t in rope_cache(64, d))
    page = 4 if paged else 40
    blocks = 3 * m * 40 // page if paged else m
    kb = torch.randn(blocks, page, hkv, d, generator=g).to(DEV, dtype)
    vb = torch.randn(blocks, page, hkv, d, generator=g).to(DEV, dtype)
    tables = (torch.randperm(blocks, generator=g)[:m * 10].view(m, 10).to(DEV, torch.int32)
              if paged else None)
    pos = torch.tensor([max(n_ - 1, 0) for n_ in lens], device=DEV)  # (an empty row: a
    # padding row's token, written at position 0 and seeing no key)
    if paged:
        slot = tables.long()[torch.arange(m, device=DEV), pos // page] * page + pos % page
    else:
        slot = torch.arange(m, device=DEV) * page + pos
    return (x, w, nw, 1e-6, r, None, cos, sin, pos), (kb, vb, slot), tables, \
        torch.tensor(lens, device=DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,hq,hkv,d,k,lens,paged,cfg", [
    (1, 4, 1, 16, 40, [7], False, None), (2, 6, 2, 16, 33, [1, 38], True, None),
    (3, 8, 2, 16, 24, [17, 5, 33], True, (1, 16, 1)), (1, 4, 2, 16, 50, [40], False, (4, 16, 1)),
    (2, 2, 2, 32, 20, [12, 0], False, (16, 16, 1))])
def test_gemv_rope_attention_matches_unfused(dtype, m, hq, hkv, d, k, lens, paged, cfg):
    """The qkv GEMV with RoPE, the cache write and decode attention in one launch: qkv, h and
    the cache as gemv_rms_norm_rope leaves them, o within rounding of paged_decode over the
    written cache and of the fp32 reference; at awkward head counts, GQA groups of 1-4, pair
    tiles wider than half a head (cut down to one head a program), paged and contiguous
    caches, a new token in the first and last slot of a page, an empty row; twice in a row
    (the groups' counters are back at zero after a call)."""
    (x, w, nw, eps, r, b, cos, sin, pos), (kb, vb, slot), tables, lens_t = _attention_case(
        m, hq, hkv, d, k, lens, paged, dtype, 7 * m + d)
    kb2, vb2 = kb.clone(), vb.clone()
    for step in range(2):  # (the first call with another x: its cache rows are overwritten)
        y, h, o = gemv_rms_norm_rope_attention(
            x if step else -x, w, nw, eps, r, b, cos, sin, pos, kb.view(-1, hkv, d),
            vb.view(-1, hkv, d), slot, hq, hkv, d, kb, vb, tables, lens_t, 0.3, impl="triton",
            config=cfg)
        q = y[:, :hq * d].view(m, hq, d)
        ref = GR.group_attention_reference(q, kb, vb, tables, lens_t, 0.3)
        assert rel(o, ref) < tol(dtype), step
    y2, h2 = gemv_rms_norm_rope(x, w, nw, eps, r, b, cos, sin, pos, kb2.view(-1, hkv, d),
                                vb2.view(-1, hkv, d), slot, hq, hkv, d, impl="triton",
                                config=cfg)
    assert torch.equal(h, h2) and rel(y, y2) < tol(dtype)
    assert rel(kb, kb2) < tol(dtype) and rel(vb, vb2) < tol(dtype)
    if 0 in lens:
        assert (o[lens.index(0)] == 0).all()
    if hq // hkv <= 16:
        split = paged_decode(q, kb, vb, tables, lens_t, 0.3, None, 2)
        assert rel(o, split) < tol(dtype)
    # the reference path (impl="torch") gives the same
    kb3, vb3 = kb2.clone(), vb2.clone()
    _, _, o3 = gemv_rms_norm_rope_attention(
        x, w, nw, eps, r, b, cos, sin, pos, kb3.view(-1, hkv, d), vb3.view(-1, hkv, d), slot,
        hq, hkv, d, kb3, vb3, tables, lens_t, 0.3, impl="torch", config=cfg)
    assert rel(o3, ref) < tol(dtype)


def test_gemv_rope_attention_bad_input():
    (x, w, nw, eps, r, b, cos, sin, pos), (kb, vb, slot), tables, lens = _attention_case(
        2, 4, 1, 16, 24, [3, 4], True, torch.float32, 0)
    args = (x, w, nw, eps, r, b, cos, sin, pos, kb.view(-1, 1, 16), vb.view(-1, 1, 16), slot,
            4, 1, 16)
    with pytest.raises(ValueError, match="k_blocks"):
        gemv_rms_norm_rope_attention(*args, kb[..., :8], vb, tables, lens, 0.3)
    with pytest.raises(ValueError, match="block_tables"):
        gemv_rms_norm_rope_attention(*args, kb, vb, tables[:1], lens, 0.3)
    with pytest.raises(ValueError, match="seq_lens"):
        gemv_rms_norm_rope_attention(*args, kb, vb, tables, lens[:1], 0.3)
    with pytest.raises(ValueError, match="a block per"):
        gemv_rms_norm_rope_attention(*args, kb[:1], vb[:1], None, lens, 0.3)
    kb8 = torch.zeros(kb.shape[0], kb.shape[1], 1, 8, device=DEV)  # head_dim 8: too narrow
    with pytest.raises(ValueError, match="power of two"):
        gemv_rms_norm_rope_attention(x, w[:48], nw, eps, r, b, cos[:, :4], sin[:, :4], pos,
                                     kb8.view(-1, 1, 8), kb8.view(-1, 1, 8), slot, 4, 1, 8, kb8,
                                     kb8, tables, lens, 0.3)


@pytest.mark.gpu
def test_tuned_shapes_gpu():
    """Every (N, K) in the shape tables, bf16, through the config the kernels pick for it
    (config=None), against the torch references (one of the three GEMV ops a shape, in turn)."""
    for i, (n, k) in enumerate(sorted(G.TUNED)):
        _check_projections(None, 1, n, k, torch.bfloat16, i, (i % 3,))
    for i, (n, k) in enumerate(sorted(GR.TUNED)):
        _check_rope(None, n, k, _rope_heads(n), torch.bfloat16, 100 + i)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,hq,hkv,d,k,cfg", [(1, 6, 2, 12, 50, None), (3, 4, 1, 16, 33, None),
                                             (2, 3, 3, 10, 40, (8, 16, 1)),
                                             (1, 5, 1, 8, 24, (1, 32, 2))])
def test_gemv_rms_norm_rope_matches_unfused(dtype, m, hq, hkv, d, k, cfg):
    """The qkv GEMV with RoPE + cache write in its epilogue, at awkward head counts, head dims
    (half not a power of two) and pair tiles that straddle heads: the same qkv row, cache
    rows and residual as gemv_rms_norm then rope_cache_write (layer 1's kernels, bit for bit),
    and within rounding of the torch references; other cache rows untouched."""
    g = torch.Generator().manual_seed(m * 10 + d)
    n = (hq + 2 * hkv) * d
    x, r = (torch.randn(m, k, generator=g).to(DEV, dtype) for _ in range(2))
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype)
    nw = (1 + 0.3 * torch.randn(k, generator=g)).to(DEV, dtype)
    cos, sin = (t.to(DEV) for t in rope_cache(32, d))
    pos = torch.tensor([4, 17, 0][:m], device=DEV)
    slot = torch.tensor([7, 2, 9][:m], device=DEV)

    def caches():
        return (torch.full((10, hkv, d), 7.0).to(DEV, dtype),
                torch.full((10, hkv, d), 5.0).to(DEV, dtype))
    kc, vc = caches()
    y, h = gemv_rms_norm_rope(x, w, nw, 1e-6, r, b, cos, sin, pos, kc, vc, slot, hq, hkv, d,
                              impl="triton", config=cfg)
    # unfused layer-1 kernels
    y2, h2 = gemv_rms_norm(x, w, nw, 1e-6, r, b, impl="triton")
    kc2, vc2 = caches()
    q2, k2, v2 = (t.view(m, -1, d) for t in y2.split([hq * d, hkv * d, hkv * d], dim=-1))
    rope_cache_write(q2, k2, v2, cos, sin, pos, kc2, vc2, slot, impl="triton")
    if cfg is None and DEV.type == "cpu":  # the same K tiles summed in the same order (the
        # compiled kernels' in-tile reduction order depends on the tile's layout)
        assert torch.equal(y, y2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert rel(y, y2) < tol(dtype) and rel(kc, kc2) < tol(dtype) and rel(vc, vc2) < tol(dtype)
    assert torch.equal(h, h2)
    _, k_new, v_new = (t.view(m, -1, d) for t in y.split([hq * d, hkv * d, hkv * d], dim=-1))
    assert torch.equal(kc[slot], k_new) and torch.equal(vc[slot], v_new)  # what it returns
    kc3, vc3 = caches()
    y3, h3 = gemv_rms_norm_rope_reference(x, w, nw, 1e-6, r, b, cos, sin, pos, kc3, vc3, slot,
                                          hq, hkv, d)
    assert torch.equal(h, h3)
    assert rel(y, y3) < tol(dtype) and rel(kc, kc3) < tol(dtype) and rel(vc, vc3) < tol(dtype)
    untouched = torch.ones(10, dtype=torch.bool, device=DEV)
    untouched[slot] = False
    assert (kc[untouched] == 7).all() and (vc[untouched] == 5).all()


def test_gemv_rms_norm_rope_bad_input():
    x, w, nw = torch.randn(1, 16).to(DEV), torch.randn(40, 16).to(DEV), torch.ones(16).to(DEV)
    cos, sin = (t.to(DEV) for t in rope_cache(8, 8))
    kc = torch.zeros(4, 1, 8).to(DEV)
    pos = torch.zeros(1, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="head_dim"):  # 40 rows != (3 + 2) * 8
        gemv_rms_norm_rope(x, w, nw, 1e-6, None, None, cos, sin, pos, kc, kc, pos, 4, 1, 8)
    with pytest.raises(ValueError, match="slots"):
        gemv_rms_norm_rope(x, w, nw, 1e-6, None, None, cos, sin, pos, kc, kc, pos[:0], 3, 1, 8)
    with pytest.raises(ValueError, match="k_cache"):
        gemv_rms_norm_rope(x, w, nw, 1e-6, None, None, cos, sin, pos, kc[:, :, :4], kc, pos,
                           3, 1, 8)
    with pytest.raises(ValueError, match="powers of two"):
        gemv_rms_norm_rope(x, w, nw, 1e-6, None, None, cos, sin, pos, kc, kc, pos, 3, 1, 8,
                           config=(3, 16, 1))


def _attn_ref(q, k, v, lens, scale, window):
    out = torch.zeros_like(q, dtype=torch.float64)
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    for b in range(B):
        n = int(lens[b])
        lo = 0 if window is None else max(0, n - window)
        kk, vv = k[b, lo:n].double(), v[b, lo:n].double()  # (n, Hkv, D)
        for h in range(Hq):
            s = (kk[:, h // (Hq // Hkv)] @ q[b, h].double()) * scale
            out[b, h] = torch.softmax(s, 0) @ vv[:, h // (Hq // Hkv)]
    return out


@pytest.mark.parametrize("splits,fused,window", [(1, True, None), (3, True, None),
                                                 (5, False, None), (4, True, 7)])
def test_split_decode_attention_contiguous(splits, fused, window):
    g = torch.Generator().manual_seed(splits)
    B, Hq, Hkv, D, L = 3, 4, 2, 16, 45
    q = torch.randn(B, Hq, D, generator=g).to(DEV)
    k, v = (torch.randn(B, L, Hkv, D, generator=g).to(DEV) for _ in range(2))
    lens = torch.tensor([45, 1, 20], device=DEV)
    for _ in range(2):  # twice: the merge counters must be back at zero after a call
        out = paged_decode(q, k, v, None, lens, 0.25, window, splits, fused_merge=fused)
        assert rel(out, _attn_ref(q, k, v, lens, 0.25, window)) < 1e-5
    rows = torch.tensor([[2], [0], [1]], device=DEV)  # sequence b in cache row rows[b]
    out = paged_decode(q, k[[1, 2, 0]].contiguous(), v[[1, 2, 0]].contiguous(), rows, lens, 0.25,
                       window, splits)
    assert rel(out, _attn_ref(q, k, v, lens, 0.25, window)) < 1e-5


@pytest.mark.parametrize("m,n,block", [(1, 5000, 256), (3, 777, 64), (2, 16, 16), (1, 1, 16)])
def test_argmax_matches_torch(m, n, block):
    """The split argmax (pieces + last-in reduction) against torch.argmax: ties go to the first
    index (across pieces too), NaN counts as the largest; twice (the counters reset)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(m, n, generator=g).to(DEV)
    for _ in range(2):
        assert torch.equal(argmax(x, impl="triton", block=block), torch.argmax(x, -1))
    if n > 300:
        x[:, 3] = x[:, 300] = 50.0  # a tie in two pieces: the first wins
        assert torch.equal(argmax(x, impl="triton", block=block), torch.argmax(x, -1))
        x[0, 200] = float("nan")
        assert int(argmax(x, impl="triton", block=block)[0]) == 200
        x[0, 2] = x[-1, 1] = float("inf")  # NaN beats +inf (as torch); +inf beats the rest
        x[0, n - 1] = float("nan")
        assert torch.equal(argmax(x, impl="triton", block=block), torch.argmax(x, -1))
        x[-1] = float("-inf")  # every value -inf: index 0
        assert torch.equal(argmax(x, impl="triton", block=block), torch.argmax(x, -1))
    half = x.to(DTYPES[-1])
    assert torch.equal(argmax(half, impl="triton", block=block), torch.argmax(half, -1))
    with pytest.raises(ValueError, match="argmax"):
        argmax(x[0])
    # out=: written in place (a CUDA graph's static buffer), the same tensor returned
    buf = torch.full((m + 2,), -7, dtype=torch.int64, device=x.device)
    got = argmax(x, impl="triton", block=block, out=buf[:m])
    assert got.data_ptr() == buf.data_ptr() and torch.equal(buf[:m], torch.argmax(x, -1))
    assert buf[m:].tolist() == [-7, -7]
    assert torch.equal(argmax(x, impl="torch", out=buf[1:m + 1]), torch.argmax(x, -1))
    with pytest.raises(ValueError, match="out"):
        argmax(x, impl="triton", block=block, out=buf[:m].to(torch.int32))


def test_pdl_early_trigger_by_weight_bytes():
    """set_pdl's early_bytes: GEMVs over at most that many weight bytes trigger early."""
    try:
        G.set_pdl(True, early=False, early_bytes=100)
        assert G.pdl_early(100) and not G.pdl_early(101) and not G.pdl_early()
        G.set_pdl(True, early=True)
        assert G.pdl_early(10 ** 9) and G.pdl_early()
    finally:
        G.set_pdl(True, early=False, early_bytes=0)
    assert not G.pdl_early(1)


def test_pdl_early_trigger_of_the_rope_gemv_alone():
    """set_pdl's early_rope: gemv_rope (the qkv GEMV) triggers early whatever its size, the
    other GEMVs as before; off again, none."""
    try:
        G.set_pdl(True, early_rope=True)
        assert G.pdl_early(10 ** 9, rope=True) and not G.pdl_early(10 ** 9)
        assert not G.pdl_early(1)
    finally:
        G.set_pdl(True, early_rope=False)
    assert not G.pdl_early(1, rope=True)
