"""The triton backend's fused decode path (backends.DecodeKernels) against the general path:
CPU through Triton's interpreter on a tiny model (contiguous and paged caches, batch 1 and 3),
and on a GPU at Llama-3.2-1B's shape in bf16 (logits within bf16 tolerance, greedy tokens
identical)."""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import layer3_model as l3
from layer3_model import backends

GEMV = importlib.import_module("layer1_kernels.gemv")  # (the package's `gemv` is the function)
GEMV_ROPE = importlib.import_module("layer1_kernels.gemv_rope")

TINY = dict(l3.LLAMA_3_2_1B, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, head_dim=16, vocab_size=97)


def _pair(config: dict, dtype, device, impl: str):
    cfg = l3.ModelConfig.from_dict(config)
    torch.manual_seed(0)
    fused = l3.random_model(cfg, backend="triton", dtype=dtype, device=device)
    fused.set_backend("triton", impl=impl)
    plain = l3.random_model(cfg, backend="triton", dtype=dtype, device=device)
    plain.load_state_dict(fused.state_dict())
    plain.set_backend("triton", impl=impl)
    plain.ops = plain.ops.__class__(**{**plain.ops.__dict__, "decode": None})
    return cfg, fused, plain


def _count_fused(monkeypatch) -> list:
    """Calls of the fused path's norm + GEMV kernels (with or without the RoPE epilogue)."""
    calls = []
    for name in ("norm_linear", "norm_qkv_rope_write"):
        original = getattr(backends.DecodeKernels, name)

        def counted(self, *a, _original=original, **kw):
            calls.append(1)
            return _original(self, *a, **kw)
        monkeypatch.setattr(backends.DecodeKernels, name, counted)
    return calls


def _interpreted_tiles(monkeypatch):
    """Wider GEMV tiles than the interpreter's default (4 rows, 2 pairs): the interpreter's
    cost is per program, and these still split every product of TINY into several programs
    (vocab 97 = 6 x 16 + a 1-row masked tile; 160 qkv / gate_up rows, 48 hidden rows) over a
    K loop of several 16-wide steps (K 48 and 80), and gemv_rope's 4 pairs are half a head."""
    monkeypatch.setattr(GEMV, "_default_config", lambda n, k, rows: (16, 16, 1))
    monkeypatch.setattr(GEMV_ROPE, "_default_config", lambda k: (4, 16, 1))


def _decode(net, cache, context, prompt, steps: int, tables=None):
    B = len(prompt)
    def ctx(q, c):
        return (cache.context(q, c) if tables is None else cache.context(q, c, tables))
    lens = [len(p) for p in prompt]
    ops, net.ops = net.ops, l3.make_ops("torch")  # prefill: not under test (and slow interpreted)
    logits = net(torch.cat(prompt), ctx(lens, [0] * B), cache, last_only=True)
    net.ops = ops
    tokens, out = logits.argmax(-1), []
    for i in range(steps):
        logits = net(tokens, ctx([1] * B, [n + i for n in lens]), cache, last_only=True)
        out.append(logits)
        tokens = logits.argmax(-1)
    return out


@pytest.mark.parametrize("batch,paged,fuse_rope", [
    (1, False, True), (3, True, True), (2, False, True), (2, False, False)])
def test_fused_decode_matches_general_path_interpreted(batch, paged, fuse_rope, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the interpreter check runs on a CPU; the GPU test below covers CUDA")
    _interpreted_tiles(monkeypatch)
    cfg, fused, plain = _pair(TINY, torch.float32, "cpu", "triton")
    fused.ops = dataclasses.replace(  # the kernels at every row count they take
        fused.ops, decode=dataclasses.replace(fused.ops.decode, fuse_rope=fuse_rope,
                                              max_tokens=GEMV.MAX_ROWS))
    gen = torch.Generator().manual_seed(batch)
    prompt = [torch.randint(0, 97, (n,), generator=gen) for n in (5, 9, 2)[:batch]]
    if paged:
        from layer4_algorithms.kv.paged_cache import PagedKVCache
        caches = [PagedKVCache.for_model(cfg, 20, 4, dtype=torch.float32) for _ in range(2)]
        tables = [[(b * 6 + i) % 20 for i in range(8)] for b in range(batch)]
    else:
        caches = [l3.ContiguousKVCache.for_model(cfg, batch, 40, dtype=torch.float32)
                  for _ in range(2)]
        tables = None
    calls = _count_fused(monkeypatch)
    with torch.no_grad():
        a = _decode(fused, caches[0], None, prompt, 2, tables)
        assert len(calls) == 2 * (2 * cfg.num_hidden_layers + 1)  # the fused path ran
        b = _decode(plain, caches[1], None, prompt, 2, tables)
    for x, y in zip(a, b, strict=True):
        assert (x - y).abs().max() < 1e-4
        assert torch.equal(x.argmax(-1), y.argmax(-1))
    assert torch.allclose(caches[0].k, caches[1].k, atol=1e-5)
    assert torch.allclose(caches[0].v, caches[1].v, atol=1e-5)


def test_general_path_kept_for_prefill_and_large_batches(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("interpreter check")
    cfg, fused, _ = _pair(TINY, torch.float32, "cpu", "triton")
    calls = _count_fused(monkeypatch)
    n = backends.FUSED_DECODE_MAX_TOKENS + 1  # one sequence more than the fused path takes
    assert fused.ops.decode.max_tokens == n - 1
    cache = l3.ContiguousKVCache.for_model(cfg, n, 16, dtype=torch.float32)
    fused.ops = dataclasses.replace(l3.make_ops("torch"), decode=fused.ops.decode)
    with torch.no_grad():  # torch kernels, the fused decode's gate: it must stay closed
        fused(torch.randint(0, 97, (n * 3,)), cache.context([3] * n, [0] * n), cache)
        fused(torch.randint(0, 97, (n,)), cache.context([1] * n, [3] * n), cache)
    assert calls == []
    # the torch impl of the triton backend has no fused path at all
    assert l3.make_ops("triton", impl="torch").decode is None
    assert l3.make_ops("torch").decode is None


@pytest.mark.gpu
def test_fused_decode_1b_shape_gpu():
    """1B shape, random bf16 weights. Teacher-forced (all fed the general path's greedy
    tokens), the fused path's logits differ from the general path's by no more than the torch
    backend's do (the same bf16 model in other kernels: bf16's noise over 16 layers; measured
    on an H100: fused 1.9-2.4e-2, torch backend 2.3-2.6e-2, relative), and pick
    the same token wherever the general path's top-2 margin exceeds twice the largest logit
    difference. Free-running greedy tokens are identical up to the first step whose margin is
    below that (random weights have near-ties: a trained model's margins are far wider)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cfg, fused, plain = _pair(dict(l3.LLAMA_3_2_1B), torch.bfloat16, "cuda", "auto")
    eager = l3.random_model(cfg, backend="torch", dtype=torch.bfloat16, device="cuda")
    eager.load_state_dict(fused.state_dict())
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (33,), generator=gen).cuda()
    nets = (fused, plain, eager)
    caches = [l3.ContiguousKVCache.for_model(cfg, 1, 64, dtype=torch.bfloat16, device="cuda")
              for _ in nets]
    steps, worst = 12, 0.0
    with torch.no_grad():
        for net, cache in zip(nets, caches, strict=True):
            net(prompt, cache.context([33], [0]), cache, last_only=True)
        tok = torch.tensor([7], device="cuda")
        for i in range(steps):
            a, b, c = (net(tok, cache.context([1], [33 + i]), cache, last_only=True)[0]
                       for net, cache in zip(nets, caches, strict=True))
            err, noise = ((a - b).norm() / b.norm()).item(), ((c - b).norm() / b.norm()).item()
            diff = (a - b).abs().max().item()
            top2 = b.topk(2).values
            margin = (top2[0] - top2[1]).item()
            print(f"step {i}: fused vs general {err:.2e}, torch backend vs general {noise:.2e}, "
                  f"max |diff| {diff:.3f}, top-2 margin {margin:.3f}")
            assert err < max(3e-2, 1.5 * noise)
            if margin > 2 * diff:
                assert int(a.argmax()) == int(b.argmax())
            worst = max(worst, diff)
            tok = b.argmax().view(1)
    seqs = []
    for net in (fused, plain):
        cache = l3.ContiguousKVCache.for_model(cfg, 1, 64, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            logits = net(prompt, cache.context([33], [0]), cache, last_only=True)
            seq = []
            for i in range(steps):
                top2 = logits[0].topk(2).values
                seq.append((int(logits.argmax()), (top2[0] - top2[1]).item()))
                logits = net(logits.argmax(-1), cache.context([1], [33 + i]), cache,
                             last_only=True)
        seqs.append(seq)
    for (tok_f, _), (tok_p, margin) in zip(*seqs, strict=True):
        if margin <= 2 * worst:  # a near-tie: the two paths may part here
            break
        assert tok_f == tok_p


@pytest.mark.gpu
def test_fused_decode_under_cuda_graph_gpu():
    """The fused step replayed from a CUDA graph (as the decode benchmark runs it, PDL edges
    included) gives the eager fused step's logits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cfg, fused, _ = _pair(dict(TINY, vocab_size=512), torch.bfloat16, "cuda", "auto")
    fused.ops = dataclasses.replace(  # two sequences: more than the default limit takes
        fused.ops, decode=dataclasses.replace(fused.ops.decode, max_tokens=2))
    cache = l3.ContiguousKVCache.for_model(cfg, 2, 48, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        fused(torch.randint(0, 512, (10,), device="cuda"), cache.context([4, 6], [0, 0]), cache)
        graph = l3.CudaGraphDecoder(fused, cache, 2, greedy=True)
        tok, pos = torch.tensor([3, 9], device="cuda"), torch.tensor([4, 6], device="cuda")
        got = graph.step(tok, pos)
        assert torch.equal(graph.step_greedy(tok, pos), got.argmax(-1))  # layer 1's argmax
        with pytest.raises(ValueError, match="greedy=True"):
            l3.CudaGraphDecoder(fused, cache, 2).step_greedy(tok, pos)
        want = fused(tok, cache.context([1, 1], [4, 6]), cache, last_only=True)
        # PDL's early trigger (dependents launch while a GEMV streams) changes no result
        l3.comm.kernels.set_decode_pdl(True, early=True)
        try:
            early = l3.CudaGraphDecoder(fused, cache, 2).step(tok, pos)
        finally:
            l3.comm.kernels.set_decode_pdl(True, early=False)
        # ... nor does the attention's early trigger
        paged = importlib.import_module("layer1_kernels.paged_decode")
        paged.TRIGGER_EARLY["on"] = True
        try:
            moved = l3.CudaGraphDecoder(fused, cache, 2).step(tok, pos)
        finally:
            paged.TRIGGER_EARLY["on"] = False
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    assert torch.equal(early, got)
    assert torch.equal(moved, got)
