"""Pipeline parallelism: the layers cut into stages, micro-batches flowing through them.

For serving, engine.py runs layer 4's engine over stages on their own ranks (stage.py: what a
stage holds, how a step is cut into micro-batches, how stages hand off; ranks.py: which rank
holds what; with tensor_parallel_size T each stage is T ranks); in_flight.py keeps several
steps in flight, each over its own group of sequences, so the pipeline does not drain. For
training, training.py walks a schedule (schedules.py: GPipe, 1F1B) of forwards and backwards
per stage, and measures the bubble.
"""
from .engine import PPModel, StageProgram, build_stage, run_stage, start_pipeline
from .in_flight import LaneScheduler, StepsInFlight
from .schedules import bubble_fraction, gpipe, one_f_one_b, schedule, simulate
from .stage import StageKVCache, StageNet, check_pp_size, micro_batches, valid_pp_sizes
from .training import (
    PipelineResult,
    bubble_stats,
    keep_stage,
    partition,
    pipeline_step,
    stage_params,
)

__all__ = ["PPModel", "StageProgram", "build_stage", "run_stage", "start_pipeline",
           "LaneScheduler", "StepsInFlight",
           "StageNet", "StageKVCache", "check_pp_size", "valid_pp_sizes", "micro_batches",
           "gpipe", "one_f_one_b", "schedule", "simulate", "bubble_fraction",
           "pipeline_step", "PipelineResult", "partition", "stage_params", "keep_stage",
           "bubble_stats"]
