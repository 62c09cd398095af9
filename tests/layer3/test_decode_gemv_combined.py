"""The fused decode kernels' hook for a projection that runs its GEMV and combine itself
(`gemv_combined(x, silu)`: layer 5's row-parallel linears, whose all-reduce may begin in the
GEMV's epilogue): DecodeKernels.linear / silu_linear take its answer when it gives one, and run
their own GEMV and `combine` when it answers None or the module has no such method."""
from __future__ import annotations

import torch


class Row(torch.nn.Module):
    """A bias-free projection with a combine (x 10, to see it ran) and, optionally, the hook."""

    def __init__(self, weight, answer=None, hooked=True):
        super().__init__()
        self.weight, self.bias, self.answer, self.calls = weight, None, answer, []
        if not hooked:
            self.gemv_combined = None

    def combine(self, y):
        return 10 * y

    def gemv_combined(self, x, silu):
        self.calls.append(silu)
        return self.answer


def _kernels():
    from layer3_model.backends import DecodeKernels

    return DecodeKernels(impl="auto")  # CPU tensors: layer 1's torch references


def test_the_hook_is_taken_when_it_answers():
    k, w = _kernels(), torch.randn(5, 4)
    x, gu = torch.randn(1, 4), torch.randn(1, 8)
    fused = torch.full((1, 5), 7.0)
    row = Row(w, fused)
    assert k.linear(x, row) is fused and k.silu_linear(gu, row) is fused
    assert row.calls == [False, True]


def test_the_gemv_and_combine_when_it_answers_none_or_is_absent():
    k, w = _kernels(), torch.randn(5, 4)
    x, gu = torch.randn(1, 4), torch.randn(1, 8)
    want = 10 * torch.nn.functional.linear(x, w)
    a = gu[:, :4]
    want_silu = 10 * torch.nn.functional.linear(torch.nn.functional.silu(a) * gu[:, 4:], w)
    for row in (Row(w, None), Row(w, hooked=False)):
        torch.testing.assert_close(k.linear(x, row), want)
        torch.testing.assert_close(k.silu_linear(gu, row), want_silu)
    plain = torch.nn.Linear(4, 5, bias=False)
    torch.testing.assert_close(k.linear(x, plain), torch.nn.functional.linear(x, plain.weight))
