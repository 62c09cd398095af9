"""Layer 4's benchmark workloads and timers (the CLI in commands.py prints and saves them).

* throughput (nano-vllm's workload): N sequences of random token ids, input and output
  lengths uniform in [lo, hi], EOS ignored, greedy. Timed for our engine (continuous or
  static batching), layer 3's contiguous executor in fixed batches, and Hugging Face
  transformers' generate in left-padded fixed batches (each batch runs to its longest
  output; only the tokens asked for count as useful).
* prefix caching: requests that share a long prefix, with and without the prefix cache;
  mean TTFT (time to first token) after one request has put the prefix into the cache.
* a roofline floor for the throughput workload (an estimate, said so in the output).
"""
from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass

import torch

import layer3_model as l3

from ..engine import LLM


@dataclass
class Workload:
    prompts: list[list[int]]
    out_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.out_lens)

    def params(self) -> list[l3.SamplingParams]:
        return [l3.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                for n in self.out_lens]


def random_workload(num_seqs: int, lo: int, hi: int, vocab: int, seed: int = 0) -> Workload:
    """nano-vllm's bench: prompt and output lengths uniform in [lo, hi], random token ids."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(num_seqs)]
    return Workload(prompts, [rng.randint(lo, hi) for _ in range(num_seqs)])


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def warm_up(llm: LLM, wl: Workload, new_tokens: int = 8) -> None:
    """Run the workload untimed with every output cut to `new_tokens`: every prompt is
    prefilled in the same chunks the timed run uses, and decode runs at the batch sizes the
    start of the timed run sees, so Triton's compilation and autotuning for these shapes happen
    here (the decode CUDA graphs were captured when the engine was built). A cold machine
    and a warm one then time the same work (without it, a cold H100 timed 17.9k tok/s
    against a warm one's 24.2k)."""
    params = [l3.SamplingParams(temperature=0.0, max_tokens=min(n, new_tokens), ignore_eos=True)
              for n in wl.out_lens]
    llm.generate(wl.prompts, params)
    llm.block_manager.reset_prefix_cache()


def time_engine(llm: LLM, wl: Workload) -> dict:
    """Throughput of llm.generate over the workload, after warm_up over the same shapes."""
    dev = llm.model.device
    warm_up(llm, wl)
    start = _sync(dev)
    outs = llm.generate(wl.prompts, wl.params())
    seconds = _sync(dev) - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != wl.output_tokens:
        raise RuntimeError(f"the engine produced {produced} tokens, the workload asked for "
                           f"{wl.output_tokens}")
    st = llm.stats
    return {"seconds": seconds, "tokens_per_s": wl.output_tokens / seconds, "steps": st.steps,
            "preemptions": st.preemptions, "mean_ttft_s": st.mean_ttft, "mean_tpot_s": st.mean_tpot,
            "num_blocks": llm.block_manager.num_blocks}


def time_layer3(model: l3.Model, wl: Workload, batch: int) -> dict:
    """Layer 3's generate (contiguous cache) over fixed batches in arrival order."""
    params = wl.params()
    model.generate_outputs(wl.prompts[:2], params[:2])  # warm-up
    start = _sync(model.device)
    for i in range(0, len(wl.prompts), batch):
        model.generate_outputs(wl.prompts[i:i + batch], params[i:i + batch])
    seconds = _sync(model.device) - start
    return {"seconds": seconds, "tokens_per_s": wl.output_tokens / seconds}


def hf_model(source: str | dict, device: torch.device | str, dtype: torch.dtype):
    """transformers' LlamaForCausalLM: from a checkpoint dir, or random weights of a config dict."""
    import transformers  # benchmark-only dependency

    if isinstance(source, dict):
        cfg = transformers.LlamaConfig(**{k: v for k, v in source.items() if k != "torch_dtype"})
        with torch.device(device):
            return transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    return transformers.LlamaForCausalLM.from_pretrained(source, dtype=dtype).to(device).eval()


@torch.no_grad()
def time_hf(model, wl: Workload, batch: int) -> dict:
    """transformers generate over fixed, left-padded batches; each batch decodes to its longest
    requested output (min_new_tokens = max_new_tokens, greedy). Useful tokens: those asked for."""
    dev = model.device

    def run(prompts: list[list[int]], new: int) -> int:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False,
                             pad_token_id=0)
        return (out.shape[1] - width) * len(prompts)

    run(wl.prompts[:2], 4)  # warm-up
    start, computed = _sync(dev), 0
    for i in range(0, len(wl.prompts), batch):
        computed += run(wl.prompts[i:i + batch], max(wl.out_lens[i:i + batch]))
    seconds = _sync(dev) - start
    return {"seconds": seconds, "tokens_per_s": wl.output_tokens / seconds,
            "tokens_computed": computed}


def prefix_ttft(model: l3.Model, *, prefix_len: int, suffix_len: int, num_seqs: int,
                max_tokens: int,
                enable_prefix_caching: bool, seed: int = 0, **llm_kwargs) -> dict:
    """num_seqs requests = one shared prefix + their own suffix, submitted together after the
    same number of requests with the prefix and other suffixes have run: the warm-up compiles
    every kernel for these shapes (Triton specialises on sizes), and puts the prefix in the
    cache, if enabled. Mean TTFT of the second batch."""
    rng, vocab = random.Random(seed), model.config.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]

    def batch() -> list[list[int]]:
        return [prefix + [rng.randrange(vocab) for _ in range(suffix_len)] for _ in range(num_seqs)]

    warmup, prompts = batch(), batch()
    params = l3.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(model, enable_prefix_caching=enable_prefix_caching, **llm_kwargs)
    llm.generate(warmup, params)
    outs = llm.generate(prompts, params)
    ttfts = [o.metrics.ttft for o in outs]
    result = {"mean_ttft_s": sum(ttfts) / len(ttfts), "max_ttft_s": max(ttfts),
              "prefix_hit_rate": llm.stats.prefix_hit_rate,
              "outputs": [o.outputs[0].token_ids for o in outs]}
    del llm
    release_memory()
    return result


def roofline_floor_s(net: l3.LlamaModel, wl: Workload, max_num_seqs: int, bandwidth: float,
                     flops: float) -> float:
    """A lower bound on the workload's time (estimate): decode steps of at most max_num_seqs
    tokens each stream every weight once, every output token reads its context's KV, and every
    token costs 2 FLOPs per parameter (prefill at the FLOP ceiling, decode at the larger of
    the two). Ignores attention FLOPs and activations, so real engines stay above it."""
    cfg, weight_bytes = net.config, l3.weight_bytes(net)
    params = weight_bytes / net.dtype.itemsize
    kv_heads_dim = cfg.num_key_value_heads * cfg.head_dim
    kv_per_token = 2 * cfg.num_hidden_layers * kv_heads_dim * net.dtype.itemsize
    kv_reads = sum(sum(range(len(p), len(p) + n))
                   for p, n in zip(wl.prompts, wl.out_lens, strict=True))
    steps = -(-wl.output_tokens // min(max_num_seqs, len(wl.prompts)))
    decode = max((steps * weight_bytes + kv_reads * kv_per_token) / bandwidth,
                 2 * params * wl.output_tokens / flops)
    return decode + 2 * params * wl.input_tokens / flops
