"""Layer 4 — system algorithms: the serving engine's memory and scheduling.

`LLM(model_dir).generate(prompts, SamplingParams(...))` (vLLM's offline API) is built from:
`PagedKVCache` (k/v in fixed-size blocks, layer 3's KVCache protocol), `BlockManager`
(reference-counted block tables, copy-on-write for parallel sampling, hash-chained prefix
cache with LRU eviction), `Scheduler` (continuous batching, chunked prefill, preemption by
recomputation, FCFS) and `ModelRunner` (a scheduled step -> flat tensors + AttentionContext
-> layer 3's unchanged model -> sampled tokens). Outputs carry token ids, text, finish
reasons and per-request metrics (TTFT, TPOT, queue time); `LLM.stats` has throughput,
prefix-cache hit rate and preemptions.
"""
from .block_manager import BlockManager, PrefixCacheStats
from .engine import LLM, Speculator
from .model_runner import ModelRunner
from .outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from .paged_cache import (
    PagedKVCache,
    blocks_for_budget,
    bytes_per_block,
    torch_paged_decode_attention,
)
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from .sequence import SamplingParams, Sequence, SequenceStatus

__all__ = [
    # the engine
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "EngineStats",
    # its parts
    "PagedKVCache", "blocks_for_budget", "bytes_per_block", "torch_paged_decode_attention",
    "BlockManager", "PrefixCacheStats", "Sequence", "SequenceStatus",
    "Scheduler", "ScheduledSeq", "SchedulerOutput", "ModelRunner", "Speculator",
]
