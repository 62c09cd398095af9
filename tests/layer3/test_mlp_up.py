"""The op sets' mlp_up: silu_and_mul(gate_up(x)), which the triton op set runs as layer 1's
gemm_swiglu (one kernel) when LLM_STACK_GEMM_SWIGLU=1 and only where it applies: prefill-sized
steps through a plain bias-free nn.Linear in fp16/bf16, no autograd. CPU: the kernel through
Triton's interpreter (fp16); GPU: a 1B-shaped prefill with the switch on and off."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import layer3_model as l3
from layer3_model import backends

ROWS = backends.GEMM_SWIGLU_MIN_ROWS
TINY = dict(l3.LLAMA_3_2_1B, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=97,
            max_position_embeddings=256, tie_word_embeddings=False)


@pytest.fixture
def fused_calls(monkeypatch):
    """The x shapes gemm_swiglu was called with (it still runs)."""
    calls = []
    original = backends.kernels.gemm_swiglu

    def spy(x, w, **kw):
        calls.append(tuple(x.shape))
        return original(x, w, **kw)

    monkeypatch.setattr(backends.kernels, "gemm_swiglu", spy)
    return calls


def _ops(monkeypatch, on: bool | None, backend: str = "triton", impl: str = "triton"):
    if on is None:
        monkeypatch.delenv(backends.GEMM_SWIGLU_ENV, raising=False)
    else:
        monkeypatch.setenv(backends.GEMM_SWIGLU_ENV, "1" if on else "0")
    return backends.make_ops(backend, impl=impl)


def _linear(k: int = 48, f: int = 40, bias: bool = False, dtype=torch.float16):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, 2 * f, bias=bias).to(dtype)
    lin.weight.requires_grad_(False)
    return lin


def _unfused(x, lin):
    return backends.torch_silu_and_mul(lin(x).float()).to(x.dtype)


@pytest.mark.interpreter
def test_switch_on_takes_the_fused_kernel_for_prefill_rows(monkeypatch, fused_calls):
    ops, lin = _ops(monkeypatch, True), _linear()
    x = torch.randn(ROWS + 3, 48).half()
    torch.testing.assert_close(ops.mlp_up(x, lin), _unfused(x, lin), atol=2e-3, rtol=2e-3)
    assert fused_calls == [(ROWS + 3, 48)]


@pytest.mark.interpreter
def test_switch_on_keeps_the_old_path_where_it_does_not_apply(monkeypatch, fused_calls):
    ops, lin = _ops(monkeypatch, True), _linear()
    x = torch.randn(ROWS, 48).half()
    cases = [(x[:ROWS - 1], lin),                      # decode-sized step
             (x, _linear(bias=True)),                  # a bias
             (x.float(), _linear(dtype=torch.float32)),  # fp32
             (x.bfloat16(), _linear(dtype=torch.bfloat16)),  # the interpreter's bf16 dot
             (x[None], lin)]                           # not a flat (T, H) batch
    for xi, li in cases:
        out = ops.mlp_up(xi, li)
        assert out.shape == (*xi.shape[:-1], 40)
    assert fused_calls == []
    grad = _linear()
    grad.weight.requires_grad_(True)
    ops.mlp_up(x, grad)  # autograd: the kernel has no backward
    assert fused_calls == []
    with torch.no_grad():
        ops.mlp_up(x, grad)
    assert fused_calls == [(ROWS, 48)]


class _NotALinear(torch.nn.Linear):
    """A subclass (layer 3's Int8Linear and others are other modules with a weight)."""


@pytest.mark.interpreter
def test_only_a_plain_linear_is_fused(monkeypatch, fused_calls):
    ops = _ops(monkeypatch, True)
    sub = _NotALinear(48, 80, bias=False).half()
    ops.mlp_up(torch.randn(ROWS, 48).half(), sub)
    assert fused_calls == []


@pytest.mark.parametrize("on", [None, False])
def test_switch_off_by_default_and_at_0(monkeypatch, fused_calls, on):
    ops, lin = _ops(monkeypatch, on), _linear()
    x = torch.randn(ROWS, 48).half()
    torch.testing.assert_close(ops.mlp_up(x, lin), _unfused(x, lin), atol=2e-3, rtol=2e-3)
    assert fused_calls == []


def test_torch_op_sets_never_fuse(monkeypatch, fused_calls):
    lin, x = _linear(), torch.randn(ROWS, 48).half()
    for backend, impl in (("torch", "auto"), ("triton", "torch"), ("triton", "auto")):
        ops = _ops(monkeypatch, True, backend, impl)  # auto: CPU tensors take torch
        torch.testing.assert_close(ops.mlp_up(x, lin), _unfused(x, lin), atol=2e-3, rtol=2e-3)
    assert fused_calls == []


def test_bad_switch_value_is_an_error(monkeypatch):
    monkeypatch.setenv(backends.GEMM_SWIGLU_ENV, "true")
    with pytest.raises(ValueError, match=backends.GEMM_SWIGLU_ENV):
        backends.make_ops("triton")


@pytest.mark.interpreter
def test_prefill_logits_with_the_fused_mlp(monkeypatch, fused_calls):
    """A model's prefill in fp16 with only mlp_up taken from the switched-on triton op set
    (the rest torch: fast on a CPU) gives the torch backend's logits."""
    cfg = l3.ModelConfig.from_dict(TINY)
    ref = l3.random_model(cfg, seed=4, std=0.2, dtype=torch.float16)
    net = l3.random_model(cfg, seed=4, std=0.2, dtype=torch.float16)
    net.ops = dataclasses.replace(net.ops, mlp_up=_ops(monkeypatch, True).mlp_up)
    lens = [ROWS + 5, 9]
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, TINY["vocab_size"], (sum(lens),), generator=gen)
    with torch.no_grad():
        out = [n(ids, c.context(lens, [0, 0]), c) for n, c in
               ((m, l3.ContiguousKVCache.for_model(cfg, 2, 256, dtype=torch.float16, device="cpu"))
                for m in (ref, net))]
    assert fused_calls == [(sum(lens), 48)] * cfg.num_hidden_layers
    err = ((out[1].float() - out[0].float()).norm() / out[0].float().norm()).item()
    assert err < 5e-3, err


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [2048, 777])
def test_gpu_1b_prefill_switch_on_matches_off(monkeypatch, fused_calls, tokens):
    """The 1B shape (H 2048, F 8192), bf16, 4 layers, one prompt: logits with the switch on
    close to those with it off, and the fused kernel taken in every layer (on an H100/H200)."""
    shape = dict(l3.LLAMA_3_2_1B, num_hidden_layers=4)
    shape.pop("rope_scaling", None)
    cfg = l3.ModelConfig.from_dict(shape)
    net = l3.random_model(cfg, backend="triton", seed=6, std=0.02, dtype=torch.bfloat16,
                          device="cuda")
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(6))
    out = []
    for on in (False, True):
        net.ops = _ops(monkeypatch, on, "triton", "auto")
        cache = l3.ContiguousKVCache.for_model(cfg, 1, tokens, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            out.append(net(ids.cuda(), cache.context([tokens], [0]), cache).float())
    if torch.cuda.get_device_capability()[0] == 9:
        assert fused_calls == [(tokens, cfg.hidden_size)] * cfg.num_hidden_layers
    err = ((out[1] - out[0]).norm() / out[0].norm()).item()
    assert err < 2e-2, err
