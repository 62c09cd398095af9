"""Activation checkpointing: keep each decoder layer's input, recompute its inside in backward.

Backward needs what the forward computed (a matmul's input, the attention probabilities,
the SwiGLU's gate...). Kept for every layer, these activations grow with layers x tokens and
are, for long sequences, the largest part of training memory. Checkpointing a layer stores
only its input (the residual stream, B·T·H numbers) and runs the layer's forward a second
time during backward to rebuild the rest: memory per layer drops to one stream, and the
price is one extra forward per layer — about a third more compute (backward ≈ 2 forwards).

This uses torch.utils.checkpoint (reentrant form: the layer runs under no_grad and the
checkpoint saves only its inputs, so the saved-tensor count in memory.py sees exactly what
stays in memory).
"""
from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import train_adapter as A
from .memory import ActivationMeter


def checkpointed_loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor,
                      total_tokens: int | None = None, every: int = 1) -> torch.Tensor:
    """train_adapter.full_loss with every `every`-th decoder layer checkpointed (1: all).

    ids, targets (B, T). The value and gradients equal the plain loss's.
    """
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    total = total_tokens or ids.numel()
    last = A.num_units(model) - 1
    out = A.run_unit(model, 0, ids, targets, total)
    for unit in range(1, last):
        if (unit - 1) % every == 0:
            out = checkpoint(A.run_unit, model, unit, out, targets, total, use_reentrant=True)
        else:
            out = A.run_unit(model, unit, out, targets, total)
    return A.run_unit(model, last, out, targets, total)


def measure(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor,
            checkpointed: bool, repeats: int = 3) -> dict:
    """Saved activation bytes (one metered pass) and forward+backward time (best of
    `repeats` passes without the meter's hook), with or without checkpointing every layer.
    Leaves gradients in the model (zero them after)."""
    fn = checkpointed_loss if checkpointed else A.full_loss
    with ActivationMeter(lambda: list(model.parameters())) as meter:
        loss = fn(model, ids, targets)
    loss.backward()
    best = float("inf")
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        fn(model, ids, targets).backward()
        best = min(best, time.perf_counter() - t0)
    return {"checkpointed": checkpointed, "activation_bytes": meter.bytes, "step_s": best}
