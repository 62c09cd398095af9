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


def test_pdl_early_trigger():
    """set_pdl's early: every GEMV triggers its dependents early, or none does."""
    try:
        G.set_pdl(True, early=True)
        assert G.pdl_early()
    finally:
        G.set_pdl(True, early=False)
    assert not G.pdl_early()


