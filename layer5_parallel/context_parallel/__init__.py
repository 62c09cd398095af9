"""Context parallelism: one long sequence split over the ranks (ring attention).

ring_attention.py: each rank holds a load-balanced share of the sequence's Q, K and V; the K/V
pieces travel round the ring while each rank attends to the piece it holds, merging partial
softmaxes (lab 5, exercise 2 builds `attention_block` and `merge_partial`).
"""
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

__all__ = ["ring_attention", "ring_attention_simulated", "attention_block", "merge_partial",
           "shard_sequence", "unshard_sequence", "chunk_positions", "causal_work"]
