"""Layer 3 — model execution: a Llama-family executor in plain PyTorch that matches Hugging Face.

Loading: `load(path, backend=, dtype=, device=)` reads a local HF checkpoint (config.json,
model.safetensors or its sharded index, tokenizer.json, tokenizer_config.json's chat
template), a `.gguf` file (`load_gguf`: dequantized, tokenizer from its metadata), a model
name ("course", "course-draft", "smollm2" once `stack models pull smollm2` cached it,
"smollm2-shape" = random weights of its shape) or a hub id "org/name" (`resolve_model`
says where each lives), for Llama (incl. Llama-3 RoPE scaling), Qwen2, Qwen3 and
Mistral, and returns a `Model`
with `generate(prompts, SamplingParams)`, `stream(prompt, params)` (text deltas) and
`stats` (tokens/s). `ModelConfig`, `load_model`, `read_safetensors`, `save_weights`,
`random_model` and `Tokenizer` are the pieces it is built from.

The network: `LlamaModel` — RMSNorm, merged QKV projection, RoPE, GQA attention, merged
gate/up SwiGLU MLP — with kernels by backend ("torch", "triton" = layer 1's fused kernels,
"compile" = torch.compile), over a flat batch of tokens described by an `AttentionContext`.
The same model trains (layer 5's parallel schedules train it too): `model(ids (B, T))` ->
logits (B, T, V) with autograd and no cache, `model.loss(ids, targets)`, `causal_lm_loss`;
a pipeline stage runs a slice: `embed_tokens`, `causal_layers(x, slice)`, `head`. The
course model's shapes: `COURSE_SIZES` (ModelConfigs), `new_model(size, vocab, seq)`.

The seam for layer 4: attention reads and writes keys and values only through a `KVCache`
(`write(layer, k, v, ctx)`, `read(layer, ctx)`); `ContiguousKVCache` is this layer's. A
paged cache with block tables plugs in without changing the model.

Also: sampling (`SamplingParams`, `sample`, `top_k_filter`, `top_p_filter`;
`StructuredOutputsParams`, what a constrained output must match), W8A16
quantization (`quantize_model`, `perplexity`), `CudaGraphDecoder` (decode step
replayed from a CUDA graph) and `CudaGraphPrefill` (batch-1 prefill replayed from a CUDA
graph per prompt-length bucket).

The layer beneath is `comm` (layer 2, as a namespace: `comm.ring_all_reduce`). This package's
own files write `from layer2_comm import kernels` and call `kernels.rms_norm` (one hop: layer 2
relays layer 1), and take layer 0's tools by name (`from layer2_comm import time_fn`).

For layer 4 (its paged-attention kernel and benchmarks), re-exported from below:
`comm` (layer 2's collectives, which layer 4 passes on to layer 5), `INTERPRETED` (Triton runs
through its CPU interpreter here; importing this package has already set TRITON_INTERPRET, so
kernels defined after `import layer3_model` pick it up), `kernel_device`, `use_triton(impl,
tensor, op)` (the impl="auto"|"triton"|"torch" choice), `refuse_interpreted_bf16_dot`, the
paged decode kernel `paged_decode`, `paged_decode_splits` and the split row `argmax` (greedy
sampling's pick, torch.argmax's result) (layer 1's); `time_fn`, `Timing`,
`load_ceilings`, `Ceilings`, `DATASHEETS`, `results_dir`, `system_info`, `run_command` (layer 0's).
"""
import layer2_comm as comm  # the layer beneath, as a namespace: comm.ring_all_reduce

from .attention_context import AttentionContext, ContiguousKVCache, HostStaging, KVCache
from .backends import (
    BACKENDS,
    PREFILL_ATTENTION,
    Ops,
    cudnn_attention_works,
    make_ops,
    pads_prefill_attention,
)
from .bench_rows import rows_table, unmeasured_roofline
from .config import SUPPORTED_MODEL_TYPES, ModelConfig, RopeScaling
from .course_model import COURSE_MODEL_SIZES, course_model_dir
from .cuda_graph import CudaGraphDecoder, capture_graph, graph_replay_us, warm_up
from .generate import (
    GeneratingSequence,
    Generation,
    GenerationStats,
    Model,
    benchmark_decode,
    load,
)
from .gguf_load import gguf_config, load_gguf
from .meta_init import meta_device
from .model import LlamaModel, causal_lm_loss
from .models_command import models_main
from .prefill_graph import CudaGraphPrefill
from .quantize import Int8Linear, perplexity, quantize_model, weight_bytes
from .registry import cache_dir as model_cache_dir
from .registry import resolve as resolve_model
from .sampling import (
    SamplingParams,
    make_generator,
    sample,
    sample_guarded,
    top_k_filter,
    top_p_filter,
)
from .shapes import LLAMA_3_2_1B
from .stopping import FinishRule
from .structured_outputs import StructuredOutputsParams
from .tokenizer import IncrementalDecoder, Tokenizer, encode_prompt
from .training import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    STOP_STRINGS,
    VALIDATION_PLAYS,
    clean_corpus,
    course_config,
    format_play,
    hf_config,
    load_hf,
    new_model,
    parse_play,
    render_chat,
    save_hf,
    train_tokenizer,
)
from .training import SIZES as COURSE_SIZES
from .training import prepare as prepare_corpus
from .weights import load_model, random_model, read_safetensors, save_weights

# For layer 4 (see above): layer 1's Triton plumbing and paged decode kernel, one hop down.
INTERPRETED, kernel_device = comm.kernels.INTERPRETED, comm.kernels.kernel_device
use_triton = comm.kernels.use_triton
refuse_interpreted_bf16_dot = comm.kernels.refuse_interpreted_bf16_dot
paged_decode, paged_decode_splits = comm.kernels.paged_decode, comm.kernels.paged_decode_splits
argmax = comm.kernels.argmax
# layer 0's tools, from layer 2 by name, passed up by name for layer 4
time_fn, Timing = comm.time_fn, comm.Timing
load_ceilings, Ceilings = comm.load_ceilings, comm.Ceilings
DATASHEETS, system_info = comm.DATASHEETS, comm.system_info
results_dir, run_command = comm.results_dir, comm.run_command

__all__ = [
    # load and generate
    "load", "Model", "Generation", "GenerationStats", "GeneratingSequence", "benchmark_decode",
    "unmeasured_roofline", "rows_table",
    # model names (course, smollm2, smollm2-shape, hub ids), the cache, GGUF files
    "resolve_model", "model_cache_dir", "models_main", "load_gguf", "gguf_config",
    # configuration, weights, tokenizer
    "ModelConfig", "RopeScaling", "SUPPORTED_MODEL_TYPES",
    "load_model", "read_safetensors", "save_weights", "random_model", "meta_device",
    "Tokenizer", "IncrementalDecoder", "encode_prompt",
    # the network, its kernels and the KV-cache seam
    "LlamaModel", "causal_lm_loss", "BACKENDS", "PREFILL_ATTENTION", "Ops", "make_ops",
    "pads_prefill_attention", "cudnn_attention_works",
    "AttentionContext", "KVCache", "ContiguousKVCache", "HostStaging",
    # sampling
    "SamplingParams", "sample", "sample_guarded", "make_generator", "top_k_filter", "top_p_filter",
    "StructuredOutputsParams",
    # when a completion ends (EOS, stop strings, max_tokens) and what text may stream yet
    "FinishRule",
    # a real model's shape for benchmarks with random weights (meta-llama/Llama-3.2-1B)
    "LLAMA_3_2_1B",
    # quantization and CUDA graphs
    "quantize_model", "Int8Linear", "perplexity", "weight_bytes", "CudaGraphDecoder",
    "CudaGraphPrefill", "capture_graph", "warm_up", "graph_replay_us",
    # the course model: corpus, tokenizer, training (python -m layer3_model.training.train)
    "prepare_corpus", "clean_corpus", "parse_play", "format_play", "VALIDATION_PLAYS",
    "train_tokenizer", "render_chat", "CHAT_TEMPLATE", "SPECIAL_TOKENS", "STOP_STRINGS",
    "COURSE_SIZES", "course_config", "new_model", "hf_config", "save_hf", "load_hf",
    "course_model_dir", "COURSE_MODEL_SIZES",
    # from the layers below, for layer 4: layer 2's collectives, layer 1's Triton plumbing and
    # paged decode kernel, layer 0's tools
    "comm",
    "INTERPRETED", "kernel_device", "use_triton", "refuse_interpreted_bf16_dot",
    "paged_decode", "paged_decode_splits", "argmax",
    "time_fn", "Timing", "load_ceilings", "Ceilings", "DATASHEETS", "results_dir", "system_info",
    "run_command",
]
