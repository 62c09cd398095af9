"""Layer 5 — parallelism: the engine over several ranks, and training over several ranks.

One folder per form, in the order the README teaches them:
    tensor_parallel/    every layer's weights split over the ranks (Megatron: f and g)
    pipeline_parallel/  the layers cut into stages, micro-batches flowing through
    data_parallel/      whole replicas: DDP, ZeRO, checkpointing (training); replica engines
    expert_parallel/    an MoE's experts split over the ranks (all-to-all)
    context_parallel/   one long sequence split over the ranks (ring attention)
    runtime/            the worker processes tensor and pipeline parallelism share
    bench/              the benchmarks and the `stack` commands
Serving: `LLM(model, tensor_parallel_size=T, pipeline_parallel_size=P, data_parallel_size=D,
enable_expert_parallel=...)` is layer 4's engine over T x P ranks (llm.py), D times over.
`stack plan` picks a layout for a model and a set of GPUs (planner.py).

Re-exported from layer 4 for layer 6: the engine API (`LLM`, `SamplingParams`, outputs).
"""
import layer4_algorithms as engine  # the layer beneath, as a namespace: engine.BlockManager
from layer4_algorithms import (  # re-exported for layer 6
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    run_command,
)

from . import train_adapter
from .bench.expert_context import bench_expert_context, format_expert_context, moe_imbalance
from .bench.pp import bench_pp, format_pp
from .bench.timeline import plot_rank_timelines, plot_timeline
from .bench.training import bench_training, format_training, zero_table
from .context_parallel.ring_attention import (
    attention_block,
    causal_work,
    chunk_positions,
    merge_partial,
    ring_attention,
    ring_attention_simulated,
    shard_sequence,
    unshard_sequence,
)
from .data_parallel import (
    ActivationMeter,
    DistributedDataParallel,
    MemoryRow,
    ZeroTrainer,
    checkpointed_loss,
    format_table,
    overlap_fraction,
    replica_share,
    tensor_bytes,
    zero_formula,
)
from .data_parallel.replicas import ReplicaSet
from .engine_config import EngineConfig
from .expert_parallel import (
    MIXTRAL_TINY,
    QWEN_MOE_TINY,
    ExpertParallelModel,
    ExpertParallelMoE,
    MoEBlock,
    MoEConfig,
    MoELlamaModel,
    MoEModelConfig,
    MoEStats,
    MoETransformer,
    Routing,
    expert_load,
    expert_ranges,
    moe_config,
    random_moe_model,
    reset_expert_load,
    route,
)
from .llm import LLM
from .pipeline_parallel import (
    PipelineResult,
    bubble_fraction,
    bubble_stats,
    gpipe,
    keep_stage,
    one_f_one_b,
    partition,
    pipeline_step,
    simulate,
    stage_params,
)
from .runtime import TPComm
from .tensor_parallel import (  # lab 5, exercise 1: Megatron's f and g
    SequenceParallelMLP,
    TPModel,
    column_parallel_linear,
    copy_to_tp_region,
    gather_rows,
    mlp_block,
    reduce_from_tp_region,
    reduce_scatter_rows,
    row_parallel_linear,
    shard_model,
    tp_config,
    valid_tp_sizes,
)

# For layer 6, from the layers beneath, one hop each: the prompt encoder, the course model and
# its stop strings and plays (layer 3), random weights of a real model's shape for benchmarks
# (layer 3), a free TCP port (layer 2).
encode_prompt, course_model_dir = engine.executor.encode_prompt, engine.executor.course_model_dir
STOP_STRINGS, VALIDATION_PLAYS = engine.executor.STOP_STRINGS, engine.executor.VALIDATION_PLAYS
ModelConfig, random_model, save_hf = (
    engine.executor.ModelConfig, engine.executor.random_model, engine.executor.save_hf)
free_port = engine.comm.free_port

__all__ = [
    "engine",
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "EngineStats",
    # from the layers beneath, for layer 6
    "encode_prompt", "course_model_dir", "STOP_STRINGS", "VALIDATION_PLAYS",
    "ModelConfig", "random_model", "save_hf", "free_port", "run_command",
    "EngineConfig", "ReplicaSet",
    # tensor parallelism
    "shard_model", "tp_config", "valid_tp_sizes", "TPComm", "TPModel",
    "copy_to_tp_region", "reduce_from_tp_region", "column_parallel_linear", "row_parallel_linear",
    "SequenceParallelMLP", "mlp_block", "gather_rows", "reduce_scatter_rows",
    # pipeline parallelism (training) and its measurements
    "pipeline_step", "PipelineResult", "partition", "stage_params", "bubble_stats",
    "keep_stage", "bench_pp", "format_pp",
    "gpipe", "one_f_one_b", "simulate", "bubble_fraction", "plot_timeline", "plot_rank_timelines",
    # data parallelism (DDP, ZeRO, checkpointing)
    "DistributedDataParallel", "overlap_fraction", "replica_share",
    "ZeroTrainer", "checkpointed_loss", "ActivationMeter", "MemoryRow", "tensor_bytes",
    "zero_formula", "format_table", "train_adapter",
    "bench_training", "format_training", "zero_table",
    # expert parallelism
    "MoEBlock", "MoEStats", "Routing", "route", "ExpertParallelMoE", "expert_ranges",
    "MoEConfig", "MoETransformer", "ExpertParallelModel", "MIXTRAL_TINY", "QWEN_MOE_TINY",
    "bench_expert_context", "format_expert_context", "moe_imbalance",
    "MoELlamaModel", "MoEModelConfig", "moe_config", "random_moe_model", "expert_load",
    "reset_expert_load",
    # context parallelism
    "ring_attention", "ring_attention_simulated", "attention_block", "merge_partial",
    "shard_sequence", "unshard_sequence", "chunk_positions", "causal_work",
]
