"""Per-rank training memory: what a rank holds, counted in bytes, and ZeRO's formulas.

Measured: the bytes of the tensors a rank holds, each storage counted once (a gradient that
is a view of a flat buffer costs the buffer, not twice). Activations are the tensors
autograd saves for backward during the forward (`ActivationMeter`, a saved-tensors hook),
parameters excluded; this is what activation checkpointing shrinks.

The ZeRO paper (Rajbhandari et al. 2020) counts, for Ψ parameters on N data-parallel ranks
with mixed-precision Adam (fp16 parameters and gradients: 2 + 2 bytes; fp32 master weights,
momentum and variance: K = 12 bytes):

    baseline DDP   (2 + 2 + K) Ψ
    ZeRO-1 (P_os)  (2 + 2) Ψ + K Ψ / N
    ZeRO-2 (P_os+g) 2 Ψ + (2 + K) Ψ / N
    ZeRO-3 (P_os+g+p) (2 + 2 + K) Ψ / N

This layer trains in fp32 with no master copy (4-byte parameters and gradients, K = 8:
Adam's two moments), the same formulas with (4, 4, 8) in place of (2, 2, 12).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

PAPER_BYTES = (2, 2, 12)  # fp16 params, fp16 grads, fp32 master + Adam moments
FP32_BYTES = (4, 4, 8)  # what this layer trains with


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (None and empty ones cost 0)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state tensors (Adam: exp_avg, exp_avg_sq;
    the 0-d step counters are left out, as the formulas leave them out)."""
    return tensor_bytes(t for state in optimizer.state.values() for t in state.values()
                        if isinstance(t, torch.Tensor) and t.dim() > 0)


class ActivationMeter:
    """Counts the bytes autograd saves for backward inside the `with` block.

        with ActivationMeter(lambda: list(model.parameters())) as meter:
            loss = model_loss(...)
        meter.bytes  # distinct storages saved, parameters (and views of them) excluded

    `params` is called at each save, since ZeRO-3 moves parameters between storages.
    """

    def __init__(self, params: Callable[[], Iterable[torch.Tensor]] = list) -> None:
        self._params = params
        self._storages: dict[int, int] = {}
        self._hooks = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.numel() > 0:
            s = t.untyped_storage()
            params = {p.untyped_storage().data_ptr() for p in self._params() if p.numel()}
            if s.data_ptr() not in params:
                self._storages[s.data_ptr()] = s.nbytes()
        return t

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())


@dataclass
class MemoryRow:
    """One rank's bytes by kind, measured, next to the formula's (None where none applies)."""

    label: str
    params: int
    grads: int
    optimizer: int
    activations: int
    formula: dict | None = None

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer


def zero_formula(stage: int, psi: int, world: int,
                 bytes_per: tuple[int, int, int] = FP32_BYTES) -> dict:
    """Per-rank bytes of parameters, gradients and optimizer state under ZeRO `stage` (0 =
    plain data parallelism) for psi parameters on `world` ranks; psi must be divisible."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if psi % world:
        raise ValueError(f"psi ({psi}) must be a multiple of world ({world}): pad it")
    p, g, k = bytes_per
    shard = psi // world
    return {"params": p * (shard if stage >= 3 else psi),
            "grads": g * (shard if stage >= 2 else psi),
            "optimizer": k * (shard if stage >= 1 else psi)}


def format_table(rows: list[MemoryRow]) -> str:
    """A text table: measured bytes per kind and the formula's total, in KiB."""
    head = (f"{'setup':<22}{'params':>10}{'grads':>10}{'optim':>10}{'states':>10}"
            f"{'formula':>10}{'activ.':>10}   (KiB per rank)")
    lines = [head, "-" * len(head)]
    for r in rows:
        f = "" if r.formula is None else f"{sum(r.formula.values()) / 1024:10.1f}"
        lines.append(f"{r.label:<22}{r.params / 1024:10.1f}{r.grads / 1024:10.1f}"
                     f"{r.optimizer / 1024:10.1f}{r.states / 1024:10.1f}{f:>10}"
                     f"{r.activations / 1024:10.1f}")
    return "\n".join(lines)
