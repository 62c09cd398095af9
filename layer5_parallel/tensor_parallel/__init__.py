"""Tensor parallelism: every layer's weights split over the ranks, which all run every token.

shard.py cuts a loaded layer-3 model Megatron-style (column-parallel qkv and gate|up,
row-parallel o_proj and down with one all-reduce each, vocab-parallel embedding and LM head);
engine.py runs layer 4's engine over the shards (rank 0's TPModel, the workers' ShardProgram);
megatron.py is the same idea with autograd — Megatron's f and g and the column/row-parallel
linears lab 5 builds; sequence_parallel.py is Megatron's sequence parallelism (the norms'
tokens split too: all-gather in, reduce-scatter out).
"""
from .engine import ShardProgram, TPModel, build_shard, start_tensor_parallel
from .megatron import (
    column_parallel_linear,
    copy_to_tp_region,
    reduce_from_tp_region,
    row_parallel_linear,
)
from .sequence_parallel import SequenceParallelMLP, gather_rows, mlp_block, reduce_scatter_rows
from .shard import check_tp_size, shard_model, split_bounds, tp_config, valid_tp_sizes

__all__ = ["shard_model", "tp_config", "valid_tp_sizes", "check_tp_size", "split_bounds",
           "TPModel", "ShardProgram", "build_shard", "start_tensor_parallel",
           "copy_to_tp_region", "reduce_from_tp_region", "column_parallel_linear",
           "row_parallel_linear", "SequenceParallelMLP", "mlp_block", "gather_rows",
           "reduce_scatter_rows"]
