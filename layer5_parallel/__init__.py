"""Layer 5 — parallelism: the engine over several ranks, and training over several ranks.

Serving: `LLM(model, tensor_parallel_size=N, pipeline_parallel_size=P,
enable_expert_parallel=...)` is layer 4's engine with the model sharded (tp.py, pp_engine.py,
ep_model.py). Training: pipeline schedules, DDP, ZeRO-1/2/3, activation checkpointing, ring
attention and sequence parallelism, each checked against one process. `stack plan` picks a
layout for a model and a set of GPUs (planner.py).

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

# training parallelism: pipeline (GPipe, 1F1B), DDP, ZeRO-1/2/3, activation checkpointing
from . import train_adapter
from .checkpointing import checkpointed_loss
from .data_parallel import DistributedDataParallel, overlap_fraction, replica_share

# tensor parallelism: the sharded model and the engine over ranks (LLM is layer 4's at tp=1)
from .engine_config import EngineConfig

# expert and context parallelism (moe, expert_parallel, ring_attention, sequence_parallel)
from .ep_cp_bench import bench_expert_context, format_expert_context, moe_imbalance
from .ep_model import (  # an MoE model through the engine (expert-parallel under TP)
    MoELlamaModel,
    MoEModelConfig,
    expert_load,
    moe_config,
    random_moe_model,
    reset_expert_load,
)
from .expert_parallel import ExpertParallelMoE, expert_ranges
from .llm import LLM, TPModel
from .megatron_fg import (  # lab 5, exercise 1 (the TP engine's own layers are in tp.py)
    column_parallel_linear,
    copy_to_tp_region,
    reduce_from_tp_region,
    row_parallel_linear,
)
from .memory import ActivationMeter, MemoryRow, format_table, tensor_bytes, zero_formula
from .moe import MoEBlock, MoEStats, Routing, route
from .moe_model import (
    MIXTRAL_TINY,
    QWEN_MOE_TINY,
    ExpertParallelModel,
    MoEConfig,
    MoETransformer,
)
from .pipeline import (
    PipelineResult,
    bubble_stats,
    keep_stage,
    partition,
    pipeline_step,
    stage_params,
)
from .pipeline_inference import pipeline_forward
from .pipeline_schedules import bubble_fraction, gpipe, one_f_one_b, simulate
from .pp_bench import bench_pp, format_pp
from .ring_attention import (
    attention_block,
    causal_work,
    chunk_positions,
    merge_partial,
    ring_attention,
    ring_attention_simulated,
    shard_sequence,
    unshard_sequence,
)
from .sequence_parallel import SequenceParallelMLP, gather_rows, mlp_block, reduce_scatter_rows
from .timeline import plot_rank_timelines, plot_timeline
from .tp import shard_model, tp_config, valid_tp_sizes
from .tp_comm import TPComm
from .train_bench import bench_training, format_training, zero_table
from .zero import ZeroTrainer

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
    # tensor parallelism
    "EngineConfig", "shard_model", "tp_config", "valid_tp_sizes", "TPComm", "TPModel",
    # training parallelism (pipeline, DDP, ZeRO, checkpointing) and its measurements
    "pipeline_step", "PipelineResult", "partition", "stage_params", "bubble_stats",
    "pipeline_forward", "keep_stage", "bench_pp", "format_pp",
    "gpipe", "one_f_one_b", "simulate", "bubble_fraction", "plot_timeline", "plot_rank_timelines",
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
    "SequenceParallelMLP", "mlp_block", "gather_rows", "reduce_scatter_rows",
    # Megatron's f and g (lab 5)
    "copy_to_tp_region", "reduce_from_tp_region", "column_parallel_linear", "row_parallel_linear",
]
