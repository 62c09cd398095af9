"""Our executor against Hugging Face transformers on tiny random checkpoints (CPU, fp32).

Prefill: two prompts of different lengths in one flat batch (so the padding masks matter)
against transformers run on each prompt alone. Decode: every step's logits, then greedy
generations token for token. Llama (GQA, MQA + tied embeddings + Llama-3 RoPE scaling),
Qwen2 (q/k/v bias, MHA) and Mistral (sliding window shorter than the prompts).
"""
from __future__ import annotations

import pytest
import torch

import layer3_model as l3

pytestmark = pytest.mark.usefixtures("single_thread")

NAMES = ["llama-gqa", "llama-tied-rope3", "qwen2-bias", "mistral-window"]  # conftest.CONFIGS
ATOL = 2e-4  # fp32 throughout; observed differences are ~3e-6 on logits of magnitude ~5
PROMPTS = [[1, 17, 250, 3, 99, 42, 7, 180, 64, 5, 222], [1, 8, 130, 77, 201, 9]]
STEPS = 6


def hf_reference(hf, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """transformers on one prompt: prefill logits (L, V), then `steps` greedy decode steps
    through its own KV cache: each step's logits (V,) and the greedy tokens."""
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([prompt]), use_cache=True)
        prefill, past = out.logits[0], out.past_key_values
        tokens, step_logits = [int(prefill[-1].argmax())], []
        for _ in range(steps):
            out = hf(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            step_logits.append(out.logits[0, -1])
            tokens.append(int(out.logits[0, -1].argmax()))
    return prefill, step_logits, tokens


def ours_steps(net: l3.LlamaModel, prompts: list[list[int]], fed: list[list[int]],
               decode_steps: int = STEPS):
    """Our batched prefill logits (T, V) and, feeding fed[b][i] at step i, each decode step's (B, V)."""
    cache = l3.ContiguousKVCache.for_model(net.config, len(prompts), 64, dtype=net.dtype)
    with torch.no_grad():
        ctx = cache.context([len(p) for p in prompts], [0] * len(prompts))
        prefill = net(torch.tensor([t for p in prompts for t in p]), ctx, cache)
        steps = []
        for i in range(decode_steps):
            ctx = cache.context([1] * len(prompts), [len(p) + i for p in prompts])
            steps.append(net(torch.tensor([f[i] for f in fed]), ctx, cache))
    return prefill, steps


def check_against_hf(net: l3.LlamaModel, hf, decode_steps: int = STEPS) -> None:
    refs = [hf_reference(hf, p, decode_steps) for p in PROMPTS]
    prefill, steps = ours_steps(net, PROMPTS, [r[2] for r in refs], decode_steps)
    torch.testing.assert_close(prefill, torch.cat([r[0] for r in refs]), atol=ATOL, rtol=1e-4)
    for i, ours in enumerate(steps):
        torch.testing.assert_close(ours, torch.stack([r[1][i] for r in refs]), atol=ATOL, rtol=1e-4,
                                   msg=lambda m, i=i: f"decode step {i}: {m}")


@pytest.mark.parametrize("name", NAMES)
def test_prefill_and_every_decode_step_match_transformers(make_checkpoint, name):
    path, hf = make_checkpoint(name)
    net = l3.load_model(path)
    assert net.config.model_type == hf.config.model_type
    check_against_hf(net, hf)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_is_identical_token_for_token(make_checkpoint, name):
    path, hf = make_checkpoint(name)
    model = l3.load(path, device="cpu")
    params = l3.SamplingParams(temperature=0.0, max_tokens=STEPS + 1, ignore_eos=True)
    outs = model.generate_outputs(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_reference(hf, prompt, STEPS)[2]
        assert out.finish_reason == "length"


def test_greedy_matches_transformers_generate(make_checkpoint):
    path, hf = make_checkpoint("llama-gqa")
    model = l3.load(path, device="cpu")
    hf.generation_config.eos_token_id = None  # random weights: run the full length, as ours with ignore_eos
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    out = model.generate_outputs([PROMPTS[0]], l3.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert out[0].token_ids == ref[0, len(PROMPTS[0]):].tolist()


def test_sharded_checkpoint_loads_the_same_weights(make_checkpoint):
    path, hf = make_checkpoint("llama-gqa", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file() and not (path / "model.safetensors").exists()
    assert len(list(path.glob("model-*.safetensors"))) > 2
    check_against_hf(l3.load_model(path), hf)


def test_text_generation_round_trip(make_checkpoint):
    """Text in, text out: the prompt is tokenized with <s>, the output decodes its token ids."""
    path, _ = make_checkpoint("llama-gqa")
    model = l3.load(path, device="cpu")
    out = model.generate_outputs(["To be, or not"], l3.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.prompt_ids[0] == model.tokenizer.bos_token_id == 1
    assert out.text == model.tokenizer.decode(out.token_ids)


def test_mixed_prefill_and_decode_batch(make_checkpoint):
    """One step where sequence 0 prefills a 3-token chunk after a cached prefix while
    sequence 1 decodes one token: what layer 4's chunked prefill will send."""
    path, hf = make_checkpoint("qwen2-bias")
    net = l3.load_model(path)
    a, b = PROMPTS
    with torch.no_grad():
        ref_a = hf(input_ids=torch.tensor([a])).logits[0]
        ref_b = hf(input_ids=torch.tensor([b])).logits[0]
        cache = l3.ContiguousKVCache.for_model(net.config, 2, 32, dtype=net.dtype)
        net(torch.tensor(a[:8] + b[:5]), cache.context([8, 5], [0, 0]), cache)
        mixed = net(torch.tensor(a[8:] + b[5:]), cache.context([3, 1], [8, 5]), cache)
    torch.testing.assert_close(mixed, torch.cat([ref_a[8:], ref_b[5:]]), atol=ATOL, rtol=1e-4)


def test_cache_rows_decoupled_from_batch_order(make_checkpoint):
    """Sequences may live in any cache rows (block_tables): decode from rows (1, 0)."""
    path, hf = make_checkpoint("llama-gqa")
    net = l3.load_model(path)
    a, b = PROMPTS
    with torch.no_grad():
        cache = l3.ContiguousKVCache.for_model(net.config, 2, 32, dtype=net.dtype)
        net(torch.tensor(a[:-1] + b[:-1]), cache.context([len(a) - 1, len(b) - 1], [0, 0], rows=[1, 0]), cache)
        step = net(torch.tensor([a[-1], b[-1]]), cache.context([1, 1], [len(a) - 1, len(b) - 1], rows=[1, 0]), cache)
        ref = torch.stack([hf(input_ids=torch.tensor([p])).logits[0, -1] for p in (a, b)])
    torch.testing.assert_close(step, ref, atol=ATOL, rtol=1e-4)


def test_causal_lm_logits_without_cache(make_checkpoint):
    path, hf = make_checkpoint("mistral-window")
    net = l3.load_model(path)
    ids = torch.tensor([PROMPTS[0], PROMPTS[0][::-1]])
    with torch.no_grad():
        torch.testing.assert_close(net.causal_lm_logits(ids), hf(input_ids=ids).logits, atol=ATOL, rtol=1e-4)


@pytest.mark.interpreter
def test_triton_backend_kernels_in_interpreter_match_transformers(make_checkpoint):
    """The "triton" backend forcing layer 1's kernels (impl="triton": Triton's interpreter on
    CPU): fused residual RMSNorm, in-place RoPE on strided q/k views, SiLU-and-multiply,
    FlashAttention per sequence for prefill. Two decode steps (each step's kernels are the
    same; every interpreted step costs seconds) read and extend the cache."""
    path, hf = make_checkpoint("llama-gqa")
    net = l3.load_model(path, backend="triton")
    net.set_backend("triton", impl="triton")
    check_against_hf(net, hf, decode_steps=2)


def test_triton_backend_on_cpu_falls_back_to_references(make_checkpoint):
    path, hf = make_checkpoint("mistral-window")
    net = l3.load_model(path, backend="triton")
    assert net.backend == "triton"
    check_against_hf(net, hf)


@pytest.mark.slow
def test_compile_backend_matches_transformers(make_checkpoint):
    """torch.compile (inductor) of the norm, RoPE and SiLU ops; on a CPU it needs a C++ compiler."""
    path, hf = make_checkpoint("llama-gqa")
    net = l3.load_model(path, backend="compile")
    try:
        check_against_hf(net, hf)
    except Exception as exc:  # noqa: BLE001  (inductor reports a missing toolchain in many ways)
        if "compiler" in str(exc).lower() or "InductorError" in type(exc).__name__:
            pytest.skip(f"torch.compile cannot build kernels on this machine: {exc}")
        raise
