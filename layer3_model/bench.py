"""Layer 3's measurements: decode and prefill speed against the hardware's ceilings.

Decode at batch 1 is memory-bound: every token reads every weight once (plus the KV cache
so far), so the yardstick is memory-bandwidth utilisation,
    MBU = (weight bytes + KV bytes read) per token / seconds per token / copy bandwidth,
with layer 0's measured copy bandwidth. Prefill of a long prompt is compute-bound: the
yardstick is model-FLOP utilisation against layer 0's measured bf16 matmul rate,
    MFU = (2 * matmul params * T + attention FLOPs) / seconds / bf16 FLOP/s.
The decode loop here keeps everything on the GPU (argmax on device, no host sync per
token, as gpt-fast measures); `generate()`'s end-to-end rate, which samples and checks
stop conditions on the host every token, is reported beside it.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from layer2_comm import time_fn

from .attention_context import ContiguousKVCache
from .cuda_graph import CudaGraphDecoder, capture_graph
from .model import LlamaModel


def weight_bytes_read(net: LlamaModel) -> int:
    """Bytes of weights one decode step reads: every parameter once; the embedding matrix
    once as the tied lm_head, and when the head is untied (Llama-3.1-8B) one row of it, what
    the lookup reads (counting the whole matrix overstated the 8B's MBU by 6 points). Int8
    weights count one byte each, their scales too."""
    seen, total = set(), 0
    embed = getattr(getattr(net, "embed", None), "weight", None)
    head = getattr(getattr(net, "lm_head", None), "weight", None)
    if embed is not None and head is not None and embed.data_ptr() != head.data_ptr():
        seen.add(embed.data_ptr())
        total += embed.shape[-1] * embed.element_size()
    for t in list(net.parameters()) + list(net.buffers()):
        if (
            t.data_ptr() in seen
            or t.dim() == 0
            or t is getattr(net, "cos", None)
            or t is getattr(net, "sin", None)
        ):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def kv_bytes_per_position(net: LlamaModel) -> int:
    """K and V bytes of one cached position, all layers:
    2 * layers * kv_heads * head_dim * itemsize."""
    c = net.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * net.dtype.itemsize


def matmul_params(net: LlamaModel) -> int:
    """Parameters that take part in a matmul per token (not the embedding lookup, not norms)."""
    c = net.config
    per_layer = (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size)
    return c.num_hidden_layers * per_layer


def prefill_flops(net: LlamaModel, tokens: int) -> float:
    """FLOPs of a causal prefill of `tokens` (logits for the last token only): 2 per
    multiply-add; attention QK^T and PV over the causal half, 2 * 2 * T^2/2 * q_size per layer."""
    c = net.config
    attention = 2 * tokens * tokens * c.q_size * c.num_hidden_layers
    return 2.0 * matmul_params(net) * tokens + attention + 2.0 * c.hidden_size * c.vocab_size


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def decode_seconds_per_token(net: LlamaModel, *, prompt_len: int = 128, new_tokens: int = 256,
                             cuda_graph: bool = True, seed: int = 0) -> float:
    """Greedy batch-1 decode after a random prompt: seconds per new token, the loop kept on
    the device (tokens fed back without a host round trip). cuda_graph: replay a captured step."""
    dev = net.device
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, net.config.vocab_size, (prompt_len,), generator=gen).to(dev)
    cache = ContiguousKVCache.for_model(
        net.config, 1, prompt_len + new_tokens + 1, dtype=net.dtype, device=dev
    )
    logits = net(prompt, cache.context([prompt_len], [0]), cache, last_only=True)
    token, position = logits.argmax(-1), torch.tensor([prompt_len], device=dev)
    if cuda_graph:  # the greedy pick inside the graph (step_greedy: no logits copy)
        graph = CudaGraphDecoder(net, cache, 1, greedy=True)

        def step(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            return graph.step_greedy(tok, pos)
    else:
        def step(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            ctx = cache.context([1], [int(pos)])  # eager: host ints build the context (one sync)
            return net(tok, ctx, cache, last_only=True).argmax(-1)
    for _ in range(3):  # warm-up at the first positions (rewritten by the timed loop)
        step(token, position)
    _sync(dev)
    start = time.perf_counter()
    for i in range(new_tokens):
        token = step(token, position + i)
    _sync(dev)
    return (time.perf_counter() - start) / new_tokens


@torch.no_grad()
def prefill_seconds(net: LlamaModel, tokens: int, *, repeats: int = 10) -> float:
    """Median seconds of one causal prefill of `tokens` random tokens (batch 1)."""
    dev = net.device
    ids = torch.randint(0, net.config.vocab_size, (tokens,), device=dev)
    cache = ContiguousKVCache.for_model(net.config, 1, tokens, dtype=net.dtype, device=dev)
    ctx = cache.context([tokens], [0])
    return time_fn(
        lambda: net(ids, ctx, cache, last_only=True), warmup=2, repeats=repeats, device=dev
    ).median_s


@torch.no_grad()
def prefill_split(net: LlamaModel, tokens: int, *, repeats: int = 10) -> dict:
    """Where an eager prefill's time goes (CUDA only): `host_enqueue_s`, the host's time to
    issue one forward (the GPU idle at its start, no sync inside), and `graph_s`, the median
    replay of the same forward captured as one CUDA graph: the GPU's time alone, without
    launch gaps. An eager prefill whose enqueue time exceeds graph_s is host-bound: its
    figure measures the CPU's Python and launch speed, not the kernels."""
    dev = net.device
    ids = torch.randint(0, net.config.vocab_size, (tokens,), device=dev)
    cache = ContiguousKVCache.for_model(net.config, 1, tokens, dtype=net.dtype, device=dev)
    ctx = cache.context([tokens], [0])

    def fwd() -> torch.Tensor:
        return net(ids, ctx, cache, last_only=True)
    enqueue = []
    for _ in range(repeats):
        _sync(dev)
        start = time.perf_counter()
        fwd()
        enqueue.append(time.perf_counter() - start)
    graph, _ = capture_graph(fwd, warmup=1)
    replay = time_fn(graph.replay, warmup=2, repeats=repeats, device=dev)
    del graph
    return {"host_enqueue_s": statistics.median(enqueue), "graph_s": replay.median_s}


def prefill_runs(net: LlamaModel, tokens: int, *, runs: int = 5, repeats: int = 10) -> list[float]:
    """`runs` medians of prefill_seconds, after three untimed prefills of the same shape (JIT,
    Triton autotuning, the allocator, GPU clocks ramping), so a cold machine and a warm one
    measure the same thing; the spread over runs shows how stable the figure is."""
    prefill_seconds(net, tokens, repeats=3)
    return [prefill_seconds(net, tokens, repeats=repeats) for _ in range(runs)]


def hf_decode_seconds_per_token(
    config: dict,
    variant: str,
    *,
    prompt_len: int = 128,
    new_tokens: int = 256,
    dtype: torch.dtype = torch.bfloat16,
) -> float:
    """transformers' own generate() on a random model of the same shape, greedy, EOS never
    reached (min_new_tokens): seconds per new token after two warm-up calls.
    variant: "dynamic" (its default cache, eager) or "static": a static cache, with which
    transformers (>= 4.48) compiles the forward itself on CUDA (torch.compile, CUDA graphs)
    -- its fastest documented batch-1 setup."""
    import transformers  # test/bench-only dependency

    if variant not in ("dynamic", "static"):
        raise ValueError(f"unknown variant {variant!r}: expected 'dynamic' or 'static'")
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in config.items() if k != "torch_dtype"})
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(hf_cfg).to(dtype).eval()
    kwargs: dict = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if variant == "static":
        kwargs["cache_implementation"] = "static"
    ids = torch.randint(0, config["vocab_size"], (1, prompt_len), device="cuda")
    attn = torch.ones_like(ids)
    with torch.no_grad():
        for _ in range(2):  # compilation and graph capture happen here
            model.generate(ids, attention_mask=attn, **kwargs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=attn, **kwargs)
        torch.cuda.synchronize()
    new = out.shape[1] - prompt_len
    del model
    torch.cuda.empty_cache()
    return (time.perf_counter() - start) / new


def best_of(fn: Callable[[], float], repeats: int = 3) -> float:
    """The fastest of a few runs (the least disturbed one), after one untimed run of the same
    configuration (compilation, autotuning and graph capture happen there, not in a timed run)."""
    fn()
    return min(fn() for _ in range(repeats))
