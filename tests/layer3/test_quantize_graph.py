"""W8A16 quantization and perplexity (CPU), CUDA-graph decode and the GPU backends (gpu-marked)."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import layer3_model as l3

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[1, 17, 250, 3, 99, 42, 7, 180, 64, 5, 222], [1, 8, 130, 77, 201, 9]]
TEXT = [1, 40, 77, 120, 5, 230, 18, 99, 64, 3, 150, 12, 260, 45, 88, 201, 7, 33, 140, 9, 71, 290, 16, 55]


def hf_perplexity(hf, ids: list[int]) -> float:
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids], device=hf.device)).logits[0].float()
    return torch.exp(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:], device=hf.device))).item()


# ---- CPU: quantization and perplexity ---------------------------------------------------
def test_perplexity_matches_transformers_cross_entropy(make_checkpoint):
    path, hf = make_checkpoint("llama-gqa")
    model = l3.load(path, device="cpu")
    assert l3.perplexity(model, TEXT) == pytest.approx(hf_perplexity(hf, TEXT), rel=1e-5)
    # windows score each target once, with the context inside its window
    windowed = l3.perplexity(model.net, TEXT, window=8)
    parts = [TEXT[s:s + 9] for s in range(0, len(TEXT) - 1, 8)]
    nll = sum(math.log(hf_perplexity(hf, p)) * (len(p) - 1) for p in parts) / (len(TEXT) - 1)
    assert windowed == pytest.approx(math.exp(nll), rel=1e-5)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        l3.perplexity(model, [1])


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias"])
def test_w8a16_logits_and_perplexity_stay_close(make_checkpoint, name):
    path, _ = make_checkpoint(name)
    ref = l3.load_model(path)
    quant = l3.quantize_model(l3.load_model(path), include_lm_head=True)
    assert isinstance(quant.layers[0].attn.qkv, l3.Int8Linear) and isinstance(quant.layers[1].mlp.down, l3.Int8Linear)
    assert l3.weight_bytes(quant) < 0.45 * l3.weight_bytes(ref)  # fp32 -> int8 (+ scales, norms, embedding)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        a, b = ref.causal_lm_logits(ids), quant.causal_lm_logits(ids)
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    p_ref, p_quant = l3.perplexity(ref, TEXT), l3.perplexity(quant, TEXT)
    assert abs(p_quant - p_ref) / p_ref < 0.03


def test_int8_linear_is_the_dequantized_linear():
    lin = torch.nn.Linear(32, 24, bias=True)
    q = l3.Int8Linear(lin)
    w = q.w_int8.float() * q.scale[:, None]
    assert (w - lin.weight).abs().max() <= q.scale.max() / 2 + 1e-7  # rounding error bound
    x = torch.randn(3, 5, 32)
    torch.testing.assert_close(q(x), torch.nn.functional.linear(x, w, lin.bias))


def test_quantized_model_generates(make_checkpoint):
    path, _ = make_checkpoint("llama-tied-rope3")
    model = l3.load(path, device="cpu")
    l3.quantize_model(model.net)  # tied head: stays the float embedding
    assert model.net.lm_head.weight is model.net.embed.weight
    out = model.generate_outputs(PROMPTS, l3.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [5, 5]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error; the gpu tests capture graphs")
def test_cuda_graph_on_cpu_is_a_clear_error(make_checkpoint):
    path, _ = make_checkpoint("llama-gqa")
    net = l3.load_model(path)
    cache = l3.ContiguousKVCache.for_model(net.config, 1, 16, dtype=net.dtype)
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA GPU"):
        l3.CudaGraphDecoder(net, cache)
    model = l3.load(path, cuda_graph=True)  # on a CPU the flag is ignored: eager decode
    assert model.generate([[1, 2, 3]], l3.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))


# ---- GPU --------------------------------------------------------------------------------
def _gpu_logits(net: l3.LlamaModel, fed: list[list[int]], steps: int) -> torch.Tensor:
    """Our prefill logits of PROMPTS then `steps` decode steps feeding fed[b][i]: (T + steps*B, V)."""
    dev = net.device
    cache = l3.ContiguousKVCache.for_model(net.config, 2, 64, dtype=net.dtype, device=dev)
    with torch.no_grad():
        out = [net(torch.tensor([t for p in PROMPTS for t in p], device=dev),
                   cache.context([len(p) for p in PROMPTS], [0, 0]), cache)]
        for i in range(steps):
            ctx = cache.context([1, 1], [len(p) + i for p in PROMPTS])
            out.append(net(torch.tensor([f[i] for f in fed], device=dev), ctx, cache))
    return torch.cat(out)


def _hf_logits(hf, steps: int) -> tuple[torch.Tensor, list[list[int]]]:
    """transformers, prompt by prompt: the same rows as _gpu_logits, and its greedy tokens."""
    rows, fed = [], []
    with torch.no_grad():
        per_prompt = []
        for p in PROMPTS:
            out = hf(input_ids=torch.tensor([p], device=hf.device), use_cache=True)
            logits, past, toks, steps_out = out.logits[0], out.past_key_values, [], []
            toks.append(int(logits[-1].argmax()))
            for _ in range(steps):
                o = hf(input_ids=torch.tensor([[toks[-1]]], device=hf.device), past_key_values=past, use_cache=True)
                past = o.past_key_values
                steps_out.append(o.logits[0, -1])
                toks.append(int(o.logits[0, -1].argmax()))
            per_prompt.append((logits, steps_out))
            fed.append(toks)
        rows = [per_prompt[0][0], per_prompt[1][0]]
        for i in range(steps):
            rows.append(torch.stack([per_prompt[0][1][i], per_prompt[1][1][i]]))
    return torch.cat(rows).float(), fed


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton", "compile"])
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias", "mistral-window"])
def test_gpu_backends_fp32_match_transformers(make_checkpoint, backend, name):
    path, hf = make_checkpoint(name)
    hf = copy.deepcopy(hf).to("cuda")
    ref, fed = _hf_logits(hf, 4)
    net = l3.load_model(path, backend=backend, device="cuda")
    ours = _gpu_logits(net, fed, 4)
    # the Triton kernels multiply in tf32 (10-bit mantissa): looser than fp32 on the CPU
    torch.testing.assert_close(ours, ref, atol=5e-2 if backend == "triton" else 1e-3, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_bf16_is_as_close_to_fp32_as_transformers_bf16(make_checkpoint, backend):
    """bf16 rounds differently everywhere: compare each bf16 run with the fp32 truth, and
    ask ours to be no further from it than transformers' own bf16 run (with some slack)."""
    path, hf = make_checkpoint("llama-gqa")
    hf32 = copy.deepcopy(hf).to("cuda")
    truth, fed = _hf_logits(hf32, 4)
    hf16_err = (_hf_logits(copy.deepcopy(hf).to("cuda", torch.bfloat16), 4)[0] - truth).abs().mean()
    net = l3.load_model(path, backend=backend, dtype=torch.bfloat16, device="cuda")
    ours_err = (_gpu_logits(net, fed, 4) - truth).abs().mean()
    assert ours_err <= 1.5 * hf16_err + 1e-3, (ours_err.item(), hf16_err.item())


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_graph_replay_matches_eager_decode(make_checkpoint, backend):
    path, _ = make_checkpoint("llama-gqa")
    net = l3.load_model(path, backend=backend, device="cuda")
    caches = [l3.ContiguousKVCache.for_model(net.config, 2, 32, dtype=net.dtype, device="cuda") for _ in range(2)]
    flat = torch.tensor([t for p in PROMPTS for t in p], device="cuda")
    with torch.no_grad():
        for cache in caches:
            net(flat, cache.context([len(p) for p in PROMPTS], [0, 0]), cache)
    graph = l3.CudaGraphDecoder(net, caches[0])  # captured after prefill: must not disturb the cache
    tokens = torch.tensor([5, 6], device="cuda")
    positions = torch.tensor([len(p) for p in PROMPTS], device="cuda")
    for _ in range(5):
        replayed = graph.step(tokens, positions)
        with torch.no_grad():
            eager = net(tokens, caches[1].context([1, 1], positions.tolist()), caches[1], last_only=True)
        torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
        tokens, positions = replayed.argmax(-1), positions + 1


@pytest.mark.gpu
def test_generate_with_cuda_graph_equals_eager(make_checkpoint):
    path, _ = make_checkpoint("qwen2-bias")
    params = [l3.SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              l3.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)]
    eager = l3.load(path, device="cuda").generate_outputs(PROMPTS, params)
    graphed = l3.load(path, device="cuda", cuda_graph=True)
    for _ in range(2):  # the second call reuses the captured graph and its cache
        assert [o.token_ids for o in graphed.generate_outputs(PROMPTS, params)] == [o.token_ids for o in eager]


@pytest.mark.gpu
def test_gpu_w8a16_through_the_triton_kernel(make_checkpoint):
    path, _ = make_checkpoint("llama-gqa")
    ref = l3.load_model(path, dtype=torch.bfloat16, device="cuda")
    quant = l3.quantize_model(l3.load_model(path, dtype=torch.bfloat16, device="cuda"), include_lm_head=True)
    ids = torch.tensor([PROMPTS[0]], device="cuda")
    with torch.no_grad():
        a, b = ref.causal_lm_logits(ids), quant.causal_lm_logits(ids)
    assert (a - b).abs().max() < 0.08 * a.abs().max()
    p_ref, p_quant = l3.perplexity(ref, TEXT), l3.perplexity(quant, TEXT)
    assert abs(p_quant - p_ref) / p_ref < 0.05
