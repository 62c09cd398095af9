"""The decode hook: a KV cache with its own `decode_attention` gets decode steps (layer 4's
paged cache plugs its kernel in there); the model's output is what the padded path gives."""
from __future__ import annotations

import math

import pytest
import torch

import layer3_model as l3

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIG = l3.ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        max_position_embeddings=64, layer_windows=(None, 3))


class HookedCache(l3.ContiguousKVCache):
    """A contiguous cache that also does decode attention itself (in float64, one sequence
    at a time) and records each call, as layer 4's paged cache would."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[int, tuple[int, ...], float, int | None]] = []

    def decode_attention(self, layer, q, ctx, scale, window):
        self.calls.append((layer, tuple(q.shape), scale, window))
        keys, values = self.read(layer, ctx)  # (B, Hkv, S, D)
        group = q.shape[1] // keys.shape[1]
        out = torch.empty_like(q)
        for b, n in enumerate(ctx.seq_lens.tolist()):
            lo = 0 if window is None else max(0, n - window)
            k = keys[b, :, lo:n].double().repeat_interleave(group, 0)  # (Hq, n - lo, D)
            v = values[b, :, lo:n].double().repeat_interleave(group, 0)
            p = torch.softmax((k @ q[b].double()[:, :, None])[..., 0] * scale, dim=-1)
            out[b] = (p[:, None, :] @ v)[:, 0].to(q.dtype)
        return out


def decode_twice(backend: str, cache_cls) -> tuple[torch.Tensor, l3.ContiguousKVCache]:
    """Prefill two prompts (5 and 3 tokens), then two decode steps; the last step's logits."""
    model = l3.random_model(CONFIG, backend=backend, seed=3, std=0.3)
    cache = cache_cls.for_model(CONFIG, 2, 16, dtype=torch.float32)
    prompts = torch.tensor([5, 9, 2, 33, 17, 40, 8, 1])
    with torch.no_grad():
        logits = model(prompts, cache.context([5, 3], [0, 0]), cache, last_only=True)
        for step in range(2):
            tokens = logits.argmax(-1)
            logits = model(tokens, cache.context([1, 1], [5 + step, 3 + step]), cache, last_only=True)
    return logits, cache


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_steps_go_to_the_cache_and_agree(backend):
    plain, _ = decode_twice(backend, l3.ContiguousKVCache)
    hooked, cache = decode_twice(backend, HookedCache)
    # only the two decode steps, every layer, with that layer's window and 1/sqrt(D)
    assert cache.calls == [(layer, (2, 4, 8), 1 / math.sqrt(8), window)
                           for _ in range(2) for layer, window in enumerate(CONFIG.layer_windows)]
    torch.testing.assert_close(hooked, plain, rtol=1e-5, atol=1e-5)


def test_hook_result_is_what_attention_returns():
    """A cache whose decode_attention returns zeros changes the logits: nothing else ran."""
    class ZeroCache(l3.ContiguousKVCache):
        def decode_attention(self, layer, q, ctx, scale, window):
            return torch.zeros_like(q)

    plain, _ = decode_twice("torch", l3.ContiguousKVCache)
    zero, _ = decode_twice("torch", ZeroCache)
    assert not torch.allclose(plain, zero, atol=1e-3)


def test_a_cache_without_a_callable_hook_takes_the_padded_path():
    class NotCallable(l3.ContiguousKVCache):
        decode_attention = None  # present but not callable: the padded path runs

    # ContiguousKVCache has its own decode_attention (one SDPA call, decode_attention.py);
    # the general padded path must agree with it to rounding
    plain, _ = decode_twice("torch", l3.ContiguousKVCache)
    other, _ = decode_twice("torch", NotCallable)
    torch.testing.assert_close(other, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_out_holds_the_same_logits_and_is_returned(dtype):
    """forward(logits_out=buf): the head's output converted into buf, bit for bit what the
    call without it returns (prefill and decode steps, all rows and last_only); bad buffers
    are refused by name."""
    model = l3.random_model(CONFIG, seed=5, std=0.3).to(dtype)
    prompts = torch.tensor([5, 9, 2, 33, 17, 40, 8])
    for last_only in (True, False):
        cache = l3.ContiguousKVCache.for_model(CONFIG, 2, 16, dtype=dtype)
        with torch.no_grad():
            ctx = cache.context([4, 3], [0, 0])
            want = model(prompts, ctx, cache, last_only=last_only)
            buf = torch.full(want.shape, float("nan"))
            got = model(prompts, ctx, cache, last_only=last_only, logits_out=buf)
            assert got is buf and want.dtype == torch.float32 and torch.equal(buf, want)
            # a decode step after it (run twice: it writes the same k, v both times)
            step = cache.context([1, 1], [4, 3])
            tokens = want[[3, 6] if not last_only else [0, 1]].argmax(-1)
            want = model(tokens, step, cache, last_only=True)
            buf = torch.empty(2, CONFIG.vocab_size)
            assert model(tokens, step, cache, last_only=True, logits_out=buf) is buf
            assert torch.equal(buf, want)
    with torch.no_grad():
        for bad in (torch.zeros(2, CONFIG.vocab_size, dtype=torch.float16),
                    torch.zeros(3, CONFIG.vocab_size)):
            with pytest.raises(ValueError, match="logits_out must be float32"):
                model(prompts[:2], step, cache, last_only=True, logits_out=bad)
        with pytest.raises(ValueError, match="logits_out need an AttentionContext"):
            model(prompts[None], logits_out=torch.zeros(1, 7, CONFIG.vocab_size))
