"""Data parallelism: every rank (or replica) runs the whole model on its own share of the work.

Training: ddp.py (DDP: gradient buckets all-reduced while backward runs), zero.py (ZeRO-1/2/3:
the optimizer state, gradients and parameters sharded), checkpointing.py (recompute activations
in backward), memory.py (what a rank holds, against ZeRO's formulas).
Serving: replicas.py (`LLM(..., data_parallel_size=N)`: N whole engines, one per process and
device, the requests spread over them; nothing crosses between replicas).
"""
from .checkpointing import checkpointed_loss
from .ddp import DistributedDataParallel, overlap_fraction, replica_share
from .memory import ActivationMeter, MemoryRow, format_table, tensor_bytes, zero_formula
from .zero import ZeroTrainer

__all__ = ["DistributedDataParallel", "overlap_fraction", "replica_share", "ZeroTrainer",
           "checkpointed_loss", "ActivationMeter", "MemoryRow", "format_table", "tensor_bytes",
           "zero_formula"]
