"""ZeRO (Rajbhandari et al. 2020): data parallelism that shards the training state.

Plain data parallelism keeps N copies of everything: parameters, gradients and Adam's two
moments. ZeRO keeps one copy, cut into N shards, and moves what each step needs:

    stage 0  all-reduce the gradients; every rank updates every parameter (DDP)
    stage 1  all-reduce the gradients; rank r updates only shard r with *its* optimizer
             state (1/N of it), then the shards are all-gathered into the parameters
    stage 2  reduce-scatter the gradients: rank r only keeps gradient shard r; each unit's
             is reduce-scattered from a hook the moment backward finishes that unit, so
             whole gradients exist for one unit at a time (same bytes on the wire as an
             all-reduce, which is reduce-scatter + all-gather)
    stage 3  parameters sharded too: before a unit (the embedding, a decoder layer, the head)
             runs — forward, and again in backward — its parameters are all-gathered, and
             freed right after; its gradients are reduce-scattered as soon as its backward ends

Shards: each unit's parameters are laid out in one flat buffer, padded to a multiple of N,
and the parameters become views of it; shard r is the buffer's r-th 1/N slice. The
optimizer (torch.optim.Adam) steps on shard views, so updating a shard updates the model's
parameters in place. Collectives are layer 2's ring all-reduce, reduce-scatter and
all-gather (`engine.comm`), each with the process group's timeout.

Each rank's loss is its slice's summed token cross-entropy / the global token count, so the
summed gradients are exactly the full batch's (uneven slices included); the stages agree
with single-process Adam on the full batch to fp tolerance.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import layer4_algorithms as engine

from .. import train_adapter as A
from .memory import ActivationMeter, MemoryRow, optimizer_state_bytes, tensor_bytes, zero_formula

comm = engine.comm


class FlatUnit:
    """One unit's parameters as views of a flat buffer padded to a multiple of `world`."""

    def __init__(self, params: list[nn.Parameter], world: int, rank: int) -> None:
        self.params, self.world, self.rank = params, world, rank
        self.numel = sum(p.numel() for p in params)
        self.padded = -(-self.numel // world) * world
        self.shard_size = self.padded // world
        self.full = torch.zeros(self.padded, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        with torch.no_grad():
            for p in params:
                self.full[offset:offset + p.numel()].copy_(p.data.reshape(-1))
                offset += p.numel()
        self._bind(self.full)
        self.shard: torch.Tensor = self.full[self.slice()]  # a view while the unit is whole

    def slice(self) -> slice:
        return slice(self.rank * self.shard_size, (self.rank + 1) * self.shard_size)

    def _bind(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            p.data = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()

    def flat_grad(self) -> torch.Tensor:
        """The unit's gradients as one padded flat tensor; .grad become views of it."""
        g = self.full.new_zeros(self.padded)
        offset = 0
        for p in self.params:
            if p.grad is not None:
                g[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
            p.grad = g[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        return g

    # ---- stage 3: the parameters exist whole only between gather() and release() ------------
    # The flat buffer's *storage* is resized to 0 bytes and back (FSDP's trick), not replaced:
    # autograd may have saved views of the weights (a linear saves weight.t()); they keep
    # pointing at this storage, so freeing it really frees them, and backward reads the
    # re-gathered values through them.
    def shard_out(self) -> None:
        """Keep only this rank's shard (a copy) and free the whole buffer."""
        self.shard = self.full[self.slice()].clone()
        self.release()

    def gather(self) -> None:
        storage = self.full.untyped_storage()
        storage.resize_(self.padded * self.full.element_size())
        with torch.no_grad():
            self.full.copy_(comm.ring_all_gather(self.shard))

    def release(self) -> None:
        self.full.untyped_storage().resize_(0)
        for p in self.params:
            p.grad = None


class ZeroTrainer:
    """Train `model` (the same weights on every rank) with ZeRO `stage` 0-3 and Adam.

    step(ids, targets, total_tokens) runs forward, backward, the stage's gradient
    collectives and Adam on this rank's slice (ids, targets (b, T)) and returns the global
    loss; `memory_row()` reports what this rank held at the optimizer step.
    """

    def __init__(self, model: nn.Module, stage: int, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
        if stage == 3 and model.config.tie_word_embeddings:
            raise ValueError("ZeRO-3 here shards per unit; a tied embedding/LM head spans two")
        self.model, self.stage = model, stage
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        seen: set[int] = set()
        self.units: list[FlatUnit] = []
        for u in range(A.num_units(model)):
            params = [p for p in A.unit_params(model, u) if id(p) not in seen]
            seen.update(id(p) for p in params)
            self.units.append(FlatUnit(params, self.world, self.rank))
        if stage == 3:
            for unit in self.units:
                unit.shard_out()
        self.peak_grad_bytes = 0  # the most gradient bytes alive at once during backward
        if stage == 2:  # reduce-scatter each unit as soon as backward has finished it
            for unit in self.units:
                unit.ready = 0
                for p in unit.params:
                    p.register_post_accumulate_grad_hook(lambda _p, u=unit: self._grad_ready(u))
        self.opt_params = [u.full if stage == 0 else u.shard for u in self.units]
        self.optimizer = torch.optim.Adam(self.opt_params, lr=lr, betas=betas, eps=eps)
        self.last = MemoryRow(f"ZeRO-{stage}" if stage else "DDP (no ZeRO)", 0, 0, 0, 0)

    @property
    def psi(self) -> int:
        """Parameters, padded per unit to a multiple of the world size."""
        return sum(u.padded for u in self.units)

    def step(self, ids: torch.Tensor, targets: torch.Tensor, total_tokens: int) -> float:
        meter = ActivationMeter(lambda: [p for u in self.units for p in u.params])
        if self.stage == 3:
            loss = self._forward_backward_sharded(ids, targets, total_tokens, meter)
            grads = [u.grad_shard for u in self.units]
        else:
            with meter:
                loss = A.full_loss(self.model, ids, targets, total_tokens)
            self.peak_grad_bytes = 0
            loss.backward()
            loss = loss.detach()
            grads = [self._reduce(u) for u in self.units]
        for param, grad in zip(self.opt_params, grads, strict=True):
            param.grad = grad
        self._record(meter.bytes)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.stage in (1, 2):  # every rank updated its shard: put the whole back together
            for u in self.units:
                u.full.copy_(comm.ring_all_gather(u.shard))
        for u in self.units:
            if self.stage < 3:
                for p in u.params:
                    p.grad = None
        comm.ring_all_reduce(loss, "sum")
        return loss.item()

    def _grad_ready(self, unit: FlatUnit) -> None:
        """Stage 2, inside backward: once all of a unit's gradients are in, reduce-scatter
        them and keep only this rank's shard, so whole gradients never pile up (every rank
        runs the same backward, so the units complete in the same order everywhere)."""
        unit.ready += 1
        if unit.ready < len(unit.params):
            return
        self.peak_grad_bytes = max(self.peak_grad_bytes, self._live_grad_bytes())
        unit.grad_shard = comm.ring_reduce_scatter(unit.flat_grad(), "sum")
        unit.ready = 0
        for p in unit.params:
            p.grad = None

    def _live_grad_bytes(self) -> int:
        return tensor_bytes([p.grad for u in self.units for p in u.params]
                            + [getattr(u, "grad_shard", None) for u in self.units])

    def _reduce(self, unit: FlatUnit) -> torch.Tensor:
        """Stages 0-2: this unit's summed gradient, whole (0), a view of shard r of the whole
        (1), or shard r alone, the whole freed (2)."""
        if self.stage == 2:  # done by _grad_ready during backward
            if unit.ready or getattr(unit, "grad_shard", None) is None:
                raise RuntimeError("ZeRO-2: a unit's gradients did not all arrive in backward")
            shard, unit.grad_shard = unit.grad_shard, None
            return shard
        g = unit.flat_grad()
        self.peak_grad_bytes = max(self.peak_grad_bytes, self._live_grad_bytes())
        comm.ring_all_reduce(g, "sum")
        return g if self.stage == 0 else g[unit.slice()]

    def _forward_backward_sharded(self, ids, targets, total_tokens, meter) -> torch.Tensor:
        """Stage 3: unit by unit, gathering each unit's parameters only while it runs."""
        saved = []
        out = ids
        with meter:
            for u, unit in enumerate(self.units):
                unit.gather()
                inp = out if u == 0 else out.detach().requires_grad_()
                out = A.run_unit(self.model, u, inp, targets, total_tokens)
                unit.release()
                saved.append((inp, out))
        loss = out.detach()
        grad = None
        for u in reversed(range(len(self.units))):
            unit, (inp, out) = self.units[u], saved.pop()
            unit.gather()  # backward needs the weights again
            torch.autograd.backward(out, grad)
            grad = inp.grad if u > 0 else None
            unit.grad_shard = comm.ring_reduce_scatter(unit.flat_grad(), "sum")
            unit.release()
        return loss

    def _record(self, activations: int) -> None:
        """What this rank holds now, at the optimizer step (before Adam's state exists on the
        first step, so the optimizer bytes are taken from the shard sizes Adam will use)."""
        params = tensor_bytes(p for u in self.units for p in u.params)
        if self.stage == 3:
            params += tensor_bytes(u.shard for u in self.units)
        grads = tensor_bytes([p.grad for u in self.units for p in u.params]
                             + [q.grad for q in self.opt_params])
        state = optimizer_state_bytes(self.optimizer)
        if state == 0:  # Adam allocates its moments in its first step
            state = sum(2 * q.numel() * q.element_size() for q in self.opt_params)
        self.last = MemoryRow(self.last.label, params, grads, state, activations,
                              zero_formula(self.stage, self.psi, self.world))

    def memory_row(self) -> MemoryRow:
        return self.last
