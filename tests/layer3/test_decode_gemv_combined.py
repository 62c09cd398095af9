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


class Pending:
    """A sum sent and not yet received (layer 5's, with layer 2's receive switch): the fused
    GEMV's hooks answer `fused` (None: they cannot), receive() gives `value`."""

    def __init__(self, value, fused=None):
        self.value, self.fused, self.calls = value, fused, []
        self.shape = value.shape

    def receive(self):
        self.calls.append("receive")
        return self.value

    def norm_gemv(self, w, norm_weight, eps, residual, bias=None):
        self.calls.append(("norm_gemv", w, residual))
        return self.fused


def _norm(h):
    return torch.nn.RMSNorm(h, eps=1e-5)


def test_a_pending_sum_goes_to_the_next_norm_gemv_or_is_received_first():
    """norm_linear hands a pending x to its norm_gemv (the receive inside the GEMV) and returns
    its (y, h), combined; where that answers None, or the step wants fp32 logits, x.receive()
    and then layer 1's GEMV: what a plain x gives."""
    k, w = _kernels(), torch.randn(5, 4)
    x, res, norm = torch.randn(1, 4), torch.randn(1, 4), _norm(4)
    lin = torch.nn.Linear(4, 5, bias=False)
    y7, h7 = torch.full((1, 5), 7.0), torch.full((1, 4), 3.0)
    p = Pending(x, (y7, h7))
    y, h = k.norm_linear(p, res, norm, Row(w))
    assert torch.equal(y, 10 * y7) and h is h7  # the projection's combine after the GEMV
    assert p.calls[0][0] == "norm_gemv" and p.calls[0][2] is res and "receive" not in p.calls
    want = k.norm_linear(x, res, norm, lin)
    for p, dtype in ((Pending(x), None), (Pending(x, (y7, h7)), torch.float32)):
        y, h = k.norm_linear(p, res, norm, lin, out_dtype=dtype)
        assert "receive" in p.calls
        torch.testing.assert_close(y, want[0] if dtype is None else want[0].float())
        torch.testing.assert_close(h, want[1])


def test_a_pending_input_of_a_plain_gemv_is_received():
    k, w = _kernels(), torch.randn(5, 4)
    x, gu = torch.randn(1, 4), torch.randn(1, 8)
    assert torch.equal(k.linear(Pending(x), Row(w, None)), k.linear(x, Row(w, None)))
    assert torch.equal(k.silu_linear(Pending(gu), Row(w, None)), k.silu_linear(gu, Row(w, None)))
