"""Layer 4 — system algorithms: the serving engine's memory and scheduling.

`LLM(model_dir, EngineConfig(...)).generate(prompts, SamplingParams(...))` (vLLM's offline
API; keyword overrides of the config work too: `LLM(model_dir, num_blocks=512)`). The one
`EngineConfig` (every knob, validated once) is handed to each part at construction. Built
from: `PagedKVCache` (k/v in fixed-size blocks, layer 3's KVCache protocol), `BlockManager`
(reference-counted block tables, copy-on-write for parallel sampling, hash-chained prefix
cache with LRU eviction), `Scheduler` (continuous batching, chunked prefill, preemption by
recomputation, FCFS) and `ModelRunner` (a scheduled step -> flat tensors + AttentionContext
-> layer 3's unchanged model -> sampled tokens). Outputs carry token ids, text, finish
reasons and per-request metrics (TTFT, TPOT, queue time); `LLM.stats` has throughput,
prefix-cache hit rate and preemptions.

Subpackages: `kv` (block manager, paged cache, paged attention) and `spec` (speculative
decoding); the engine, scheduler, runner, sequence and outputs sit at the top.

Also: `paged_decode_attention` (Triton kernel reading K/V through block tables, and its torch
reference), `CudaGraphRunner` (decode steps replayed from CUDA graphs per batch bucket), and
speculative decoding (`LLM(speculative=dict(method="draft" | "ngram", k=4))`, or
`SpeculativeDecoder` over layer 3's contiguous cache; exact rejection sampling).

Structured outputs (`structured`): SamplingParams(structured_outputs=StructuredOutputsParams(
json=schema | regex= | choice= | grammar= | json_object=True)) constrains a request's output;
each step masks that request's row of logits with its grammar's token bitmask (llguidance).

Lab 4's exercises are these algorithms at teaching size; their answer key is
labs/lab4_algorithms/lab4_reference.py.
"""
# the layer beneath, as a namespace: executor.LlamaModel
import layer3_model as executor

# SamplingParams, and passed up by name for layer 5: layer 2's collectives (`comm`), layer 0's tools
from layer3_model import (
    DATASHEETS,
    SamplingParams,  # one SamplingParams for layers 3 and up (n: layer 4)
    StructuredOutputsParams,  # what a constrained output must match (structured/)
    comm,
    load_ceilings,
    run_command,
)

from . import structured
from .config import EngineConfig, SpecConfig
from .cuda_graph_runner import CudaGraphRunner, bucket_sizes
from .engine import LLM
from .kv import (
    BlockManager,
    PagedKVCache,
    PrefixCacheStats,
    blocks_for_budget,
    bytes_per_block,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from .model_runner import ModelRunner
from .outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from .sequence import Sequence, SequenceStatus
from .spec import (
    DraftModelProposer,
    EngineSpeculator,
    NgramProposer,
    Proposal,
    SpecCounts,
    SpecStats,
    SpeculativeDecoder,
    Speculator,
    accept_proposals,
    rejection_sample,
)
from .step_sampling import greedy_tokens
from .structured import GrammarCompiler, GrammarState, apply_token_bitmask_

__all__ = [
    # the layer beneath (layer 3), and for layer 5: layer 2's collectives (`comm`) and layer 0's
    # datasheets, ceilings and CLI wrapper
    "executor", "comm", "DATASHEETS", "load_ceilings", "run_command",
    # the engine
    "LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics",
    "EngineStats",
    # its parts
    "PagedKVCache", "blocks_for_budget", "bytes_per_block",
    "BlockManager", "PrefixCacheStats", "Sequence", "SequenceStatus",
    "Scheduler", "ScheduledSeq", "SchedulerOutput", "ModelRunner", "greedy_tokens", "Speculator",
    # kernels: paged decode attention, CUDA-graph decode
    "paged_decode_attention", "paged_decode_attention_reference", "CudaGraphRunner", "bucket_sizes",
    # speculative decoding
    "SpeculativeDecoder", "SpecStats", "SpecConfig", "SpecCounts", "EngineSpeculator",
    "NgramProposer",
    "DraftModelProposer", "Proposal", "rejection_sample", "accept_proposals",
    # structured outputs: grammar-constrained decoding (llguidance; a token bitmask per row)
    "structured", "StructuredOutputsParams", "GrammarCompiler", "GrammarState",
    "apply_token_bitmask_",
]
