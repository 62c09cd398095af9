"""The triton backend's opt-in cuDNN attention for a lone prompt (prefill_attention="cudnn"):
which steps take it (one prompt, nothing cached) and which keep the flash kernels, the checks
that refuse it where it cannot run, and on a GPU its logits beside the flash kernel's, eager
and replayed from a prefill graph."""
from __future__ import annotations

import pytest
import torch

import layer3_model as l3
from layer3_model.prefill_graph import CudaGraphPrefill

from .test_prefill_graph import SHAPE, small_config


def _net(seed: int, dtype=torch.float32, device="cpu", **over) -> l3.LlamaModel:
    return l3.random_model(small_config(**over), backend="triton", seed=seed, std=0.2,
                           dtype=dtype, device=device)


def test_names_and_backends_are_checked() -> None:
    assert l3.make_ops("triton").prefill_attention == "flash"  # the default
    with pytest.raises(ValueError, match="unknown prefill_attention 'fa3'"):
        l3.make_ops("triton", prefill_attention="fa3")
    for backend in ("torch", "compile"):
        with pytest.raises(ValueError, match="needs the triton backend"):
            l3.make_ops(backend, prefill_attention="cudnn")


def test_set_backend_refuses_cudnn_off_cuda_and_in_fp32() -> None:
    net = _net(0)
    with pytest.raises(ValueError, match="needs the model on a CUDA GPU; it is on cpu"):
        net.set_backend("triton", prefill_attention="cudnn")
    assert net.prefill_attention == "flash" and net.backend == "triton"  # left as it was
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="fp16 or bf16"):
            net.to("cuda").set_backend("triton", prefill_attention="cudnn")


def test_lone_prompts_take_cudnn_and_other_steps_keep_flash(monkeypatch) -> None:
    """A stand-in for layer 1's cudnn_attention_tokens (the real one needs CUDA) records its
    calls and answers with the reference: one fresh prompt calls it (and the logits are the
    flash path's), a batch of prompts, a chunk after a cached prefix and decodes do not."""
    calls = []

    def fake(q, k, v, *, scale):
        calls.append((q.shape[0], k.shape[0]))
        out = torch.empty_like(q)
        return l3.comm.kernels.flash_attention_tokens(q, k, v, out, scale=scale, impl="torch")
    monkeypatch.setattr(l3.comm.kernels, "cudnn_attention_tokens", fake)
    flash, cudnn = _net(1), _net(1)
    flash.ops = l3.make_ops("triton", impl="torch")
    cudnn.ops = l3.make_ops("triton", impl="torch", prefill_attention="cudnn")  # (no CUDA here)
    assert cudnn.prefill_attention == "cudnn"
    caches = [l3.ContiguousKVCache.for_model(n.config, 3, 64, dtype=torch.float32)
              for n in (flash, cudnn)]
    gen = torch.Generator().manual_seed(1)
    steps = [([13], [0], [0], 2),         # one fresh prompt: cuDNN, once a layer
             ([5, 9], [0, 0], [1, 2], 0),  # two prompts: the varlen kernel
             ([4], [13], [0], 0),          # a chunk after 13 cached tokens: bottom-right mask
             ([1, 1], [5, 9], [1, 2], 0)]  # decodes
    with torch.no_grad():
        for lens, done, rows, want_calls in steps:
            calls.clear()
            ids = torch.randint(0, SHAPE["vocab_size"], (sum(lens),), generator=gen)
            outs = [n(ids, c.context(lens, done, rows), c)
                    for n, c in zip((flash, cudnn), caches, strict=True)]
            assert len(calls) == want_calls, (lens, done, calls)
            assert all(nq == nk == lens[0] for nq, nk in calls)
            torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_gpu_cudnn_logits_beside_flash_eager_and_graphed() -> None:
    """bf16, head_dim 64, GQA 8/2, prompts of 1, 37, 64 and 100 tokens: cuDNN's last-token
    logits within bf16 of the flash kernel's, eagerly and replayed from CudaGraphPrefill's
    bucket graphs (the padded bucket's square problem, captured with cuDNN inside)."""
    over = dict(head_dim=64, hidden_size=512, num_attention_heads=8)
    flash = _net(2, torch.bfloat16, "cuda", **over)
    cudnn = _net(2, torch.bfloat16, "cuda", **over)
    cudnn.set_backend("triton", prefill_attention="cudnn")
    assert cudnn.prefill_attention == "cudnn"
    cfg = flash.config
    caches = [l3.ContiguousKVCache.for_model(cfg, 1, 128, dtype=torch.bfloat16, device="cuda")
              for _ in range(3)]
    graphs = CudaGraphPrefill(cudnn, caches[2], buckets=(64, 128))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n in (1, 37, 64, 100):
            ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen).cuda()
            want, eager = (net(ids, c.context([n], [0]), c, last_only=True)[0].float()
                           for net, c in zip((flash, cudnn), caches, strict=False))
            graphed = graphs.prefill(ids)
            for got in (eager, graphed):
                err = ((got - want).norm() / want.norm()).item()
                assert err < 2e-2, (n, err)
