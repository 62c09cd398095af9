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

__all__ = [
    "engine",
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "EngineStats",
]
