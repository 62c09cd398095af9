"""LLM_STACK_ATTN_L2_PREFETCH_MB: the fused decode step's attention launch asks the L2 for
the first MB of the layer's gate_up weight (layer 1's paged_decode prefetch). Off by
default; a strict switch; on, it moves timing only: every logit equals the switch-off
step's bit for bit (interpreted on a CPU, where the extra programs run without the
instruction; compiled, under a CUDA graph, on a GPU)."""
from __future__ import annotations

import importlib

import pytest
import torch

import layer3_model as l3
from layer3_model import backends

from .test_fused_decode import TINY, _decode, _interpreted_tiles, _pair

PAGED = importlib.import_module("layer1_kernels.paged_decode")


def test_switch_is_strict(monkeypatch):
    """Unset or 0: off; a whole number of MB up to the cap; anything else names the variable."""
    monkeypatch.delenv(backends.ATTN_L2_PREFETCH_ENV, raising=False)
    assert backends.attn_l2_prefetch_bytes() == 0
    for value, want in (("0", 0), ("8", 8 << 20), ("16", 16 << 20),
                        (str(backends.ATTN_L2_PREFETCH_MAX_MB),
                         backends.ATTN_L2_PREFETCH_MAX_MB << 20)):
        monkeypatch.setenv(backends.ATTN_L2_PREFETCH_ENV, value)
        assert backends.attn_l2_prefetch_bytes() == want
    for bad in ("", "on", "1.5", "-1", "8MB", str(backends.ATTN_L2_PREFETCH_MAX_MB + 1)):
        monkeypatch.setenv(backends.ATTN_L2_PREFETCH_ENV, bad)
        with pytest.raises(ValueError, match=backends.ATTN_L2_PREFETCH_ENV):
            backends.attn_l2_prefetch_bytes()


def _spy_prefetch(monkeypatch) -> list:
    """Each fused attention launch's prefetch argument."""
    seen, real = [], backends.kernels.paged_decode

    def spy(*a, prefetch=None, **kw):
        seen.append(prefetch)
        return real(*a, prefetch=prefetch, **kw)
    monkeypatch.setattr(backends.kernels, "paged_decode", spy)
    return seen


def test_prefetch_changes_no_logit_interpreted(monkeypatch):
    """Off (the default): no prefetch reaches the launch. On: each layer's launch gets its
    own gate_up weight and the switch's bytes, the extra programs run (small slices: several
    each launch), and the logits equal the switch-off run's bit for bit."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter check runs on a CPU; the GPU test below covers CUDA")
    _interpreted_tiles(monkeypatch)
    cfg, fused, _ = _pair(TINY, torch.float32, "cpu", "triton")
    prompt = [torch.randint(0, 97, (5,), generator=torch.Generator().manual_seed(1))]
    seen = _spy_prefetch(monkeypatch)
    runs = []
    for nbytes in (0, 8 << 20):
        monkeypatch.setattr(backends, "ATTN_L2_PREFETCH_BYTES", nbytes)
        monkeypatch.setattr(PAGED, "L2_SLICE_BYTES", 4096)  # gate_up: 30,720 bytes, 8 slices
        cache = l3.ContiguousKVCache.for_model(cfg, 1, 24, dtype=torch.float32)
        with torch.no_grad():
            runs.append(_decode(fused, cache, None, prompt, 2))
    layers = cfg.num_hidden_layers
    assert seen[:2 * layers] == [None] * (2 * layers)
    weights = [layer.mlp.gate_up.weight for layer in fused.layers] * 2
    assert [(w, n) for w, n in seen[2 * layers:]] == [(w, 8 << 20) for w in weights]
    for off, on in zip(*runs, strict=True):
        assert torch.equal(off, on)


@pytest.mark.gpu
def test_prefetch_changes_no_logit_under_cuda_graph_gpu(monkeypatch):
    """The fused step replayed from a CUDA graph with the attention launch's L2 prefetch on
    (1 MB gate_up weights: 4 slices of 256 KB, and 64 of 16 KB) gives the switch-off graph's
    logits bit for bit, replay after replay."""
    cfg, fused, _ = _pair(dict(TINY, hidden_size=256, intermediate_size=1024,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                               vocab_size=512), torch.bfloat16, "cuda", "auto")
    cache = l3.ContiguousKVCache.for_model(cfg, 1, 48, dtype=torch.bfloat16, device="cuda")
    seen = _spy_prefetch(monkeypatch)
    with torch.no_grad():
        fused(torch.randint(0, 512, (10,), device="cuda"), cache.context([10], [0]), cache)
        tok, pos = torch.tensor([3], device="cuda"), torch.tensor([10], device="cuda")
        monkeypatch.setattr(backends, "ATTN_L2_PREFETCH_BYTES", 0)
        graph = l3.CudaGraphDecoder(fused, cache, 1)
        want = [graph.step(tok, pos) for _ in range(2)]
        got = []
        for slice_bytes in (256 << 10, 16 << 10):
            monkeypatch.setattr(backends, "ATTN_L2_PREFETCH_BYTES", 16 << 20)
            monkeypatch.setattr(PAGED, "L2_SLICE_BYTES", slice_bytes)
            graph = l3.CudaGraphDecoder(fused, cache, 1)
            got += [graph.step(tok, pos) for _ in range(3)]
    assert any(p is not None for p in seen)  # (the path under test ran)
    assert torch.equal(want[0], want[1])
    for logits in got:
        assert torch.equal(logits, want[0])
