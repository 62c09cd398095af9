"""paged_decode's prefetch: extra programs past the split axis that ask the L2 for a later
kernel's weights while the attention runs. A prefetch moves timing only: every output must
equal the plain launch's bit for bit, and the merge counters must not see the extra
programs. On a CPU the interpreter runs them without the instruction (inline PTX does not
run there); tests/layer1/test_decode_kernels_compile.py checks the instruction is compiled
in for sm_90 (and only in the prefetching kernel)."""
from __future__ import annotations

import importlib

import pytest
import torch

from layer1_kernels import interpreter

from .test_paged_decode import contiguous, make

pd = importlib.import_module("layer1_kernels.paged_decode")  # the package's name is the function

DEV = "cpu" if interpreter.INTERPRETED else "cuda"


def test_prefetch_range_rules():
    """The range the extra programs fetch: the tensor's first bytes, capped at its size and
    rounded down to 16; none for nothing to fetch, a strided or misaligned tensor, a range
    past what one launch argument holds, or a tensor on another device. On a CPU (the
    interpreter) the programs run without the instruction."""
    w = torch.zeros(64, 100, dtype=torch.bfloat16, device=DEV)  # 12,800 bytes
    dev = w.device
    assert pd._prefetch_range(None, dev) is None
    assert pd._prefetch_range((w, 0), dev) is None and pd._prefetch_range((w, 15), dev) is None
    got = pd._prefetch_range((w, 1000), dev)
    assert got[0] is w and got[1] == 992
    assert pd._prefetch_range((w, 1 << 40), dev)[1] == 12800
    assert pd._prefetch_range((w[:, :50], 64), dev) is None  # not contiguous
    assert pd._prefetch_range((w.view(-1)[1:], 64), dev) is None  # 2 bytes off 16
    assert pd._prefetch_range((w, 64), torch.device("meta")) is None
    if interpreter.INTERPRETED:
        assert pd._prefetch_range((w, 64), dev)[2] is False


class _Grids:
    """Records each launch grid of the prefetching kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.interpreter
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_prefetch_changes_no_output(monkeypatch, paged):
    """With prefetch programs (small slices, so several slabs of them run) every output of
    the fused and unfused launch, both grid orders, one part and several, equals the plain
    launch's bit for bit; the counters are back at zero; the grid grew by just enough slabs
    for the slices."""
    if paged:
        q, k, v, t, n = make([70, 1, 33], 8, 2, 16, 8, seed=7)
    else:
        q, k, v, t, n = contiguous([70, 1, 33], 8, 2, 16, 80, seed=7)
        t = None
    w = torch.randn(40, 24, device=q.device)  # 3,840 bytes
    monkeypatch.setattr(pd, "L2_SLICE_BYTES", 256)  # 15 slices
    spy = _Grids(pd._paged_decode_l2_kernel)
    monkeypatch.setattr(pd, "_paged_decode_l2_kernel", spy)
    cfg = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "min_part": 16}
    for splits, fused, hf in ((1, True, True), (3, True, False), (3, False, True)):
        plain = pd.paged_decode(q, k, v, t, n, 0.3, None, splits, fused_merge=fused,
                                heads_first=hf, config=cfg)
        before = len(spy.grids)  # (the plain launch: not the prefetching kernel)
        got = pd.paged_decode(q, k, v, t, n, 0.3, None, splits, fused_merge=fused,
                              heads_first=hf, config=cfg, prefetch=(w, 1 << 20))
        assert len(spy.grids) == before + 1
        g0, g1, g2 = spy.grids[-1]
        assert g0 * g1 == 3 * 2 and g2 == splits + -(-15 // 6)  # (3 sequences, 2 kv heads)
        assert torch.equal(got, plain), (splits, fused, hf)
        assert int(pd._COUNTERS[q.device].abs().sum()) == 0
