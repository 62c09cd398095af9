"""Layer 5 — parallelism (being built).

Will hold tensor, pipeline, data, expert and sequence parallelism, ZeRO sharding and a
planner that picks a layout for a model and a set of GPUs.

Re-exported from layer 4 for layer 6: the engine API (`LLM`, `SamplingParams`, outputs).
"""
import layer4_algorithms as engine  # the layer beneath, as a namespace: engine.BlockManager
from layer4_algorithms import (  # re-exported for layer 6
    LLM,
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)

# expert and context parallelism (moe.py, expert_parallel.py, ring_attention.py, sequence_parallel.py)
from .expert_parallel import ExpertParallelMoE, expert_ranges
from .moe import MoEBlock, MoEStats, Routing, route
from .ring_attention import (
    attention_block,
    merge_partial,
    ring_attention,
    ring_attention_simulated,
    shard_sequence,
    unshard_sequence,
)
from .sequence_parallel import SequenceParallelMLP, gather_rows, mlp_block, reduce_scatter_rows

__all__ = [
    "engine",
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "EngineStats",
    # expert parallelism
    "MoEBlock", "MoEStats", "Routing", "route", "ExpertParallelMoE", "expert_ranges",
    # context parallelism
    "ring_attention", "ring_attention_simulated", "attention_block", "merge_partial",
    "shard_sequence", "unshard_sequence",
    "SequenceParallelMLP", "mlp_block", "gather_rows", "reduce_scatter_rows",
]
