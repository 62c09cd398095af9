"""Rank 0's model and KV cache under any parallel form: what layer 4's engine holds.

The engine asks its model for config, dtype, device and backend, and calls forward(ids, ctx,
cache); here those come from rank 0's own part of the model (a tensor-parallel shard, pipeline
stage 0, or a shard of it), and forward (written by each form: TPModel in
tensor_parallel/engine.py, PPModel in pipeline_parallel/engine.py) first tells the workers
what to run. The cache is layer 4's, made by the engine; its copy-on-write block copies are
sent to every rank as well (each holds the same blocks of its own heads or layers). The
runner is layer 4's, whose waits for a step's tokens are bounded (a rank that hangs
mid-step becomes an error on rank 0, not a hang).
"""
from __future__ import annotations

import os
import time

import torch
from torch import nn

import layer4_algorithms as engine

from .group import WorkerGroup, limit_text

CHECK_S = 0.5  # how often wait_event checks that the workers live
SPIN_S = 0.05  # how long wait_event spins on its event before napping between polls


class RankZeroModel(nn.Module):
    """Holds rank 0's `shard` and the worker `group`; looks like the shard to the engine."""

    def __init__(self, shard: nn.Module, group: WorkerGroup) -> None:
        super().__init__()
        self.shard, self.group, self.config = shard, group, shard.config
        # read on every step (a shard's own answer walks its modules to a weight): kept
        self._dtype, self._device = shard.dtype, shard.device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def backend(self) -> str:
        return self.shard.backend

    @property
    def ops(self):
        """The shard's kernels (layer 3's Ops), as layer 4's runner asks for them
        (`pads_prefill_attention(net)`): without them every mixed step counted as padded and
        was cut into passes, where the triton kernels pad nothing."""
        return self.shard.ops


class RankedKVCache(engine.PagedKVCache):
    """Layer 4's paged cache on rank 0 whose copy-on-write copies happen on every rank.
    Made by `for_group` (layer 4's for_model, then the group attached)."""

    group: WorkerGroup

    @classmethod
    def for_group(cls, group: WorkerGroup, config, num_blocks: int, block_size: int, *,
                  dtype: torch.dtype, device) -> RankedKVCache:
        cache = cls.for_model(config, num_blocks, block_size, dtype=dtype, device=device)
        cache.group = group
        return cache

    def context(self, *args, **kw):
        """Layer 4's step context; a closed group says so first (before layer 4 checks the step
        a failed one left behind). When the runner hands over the step's padded block table
        (`table=(rows, lengths)`, numpy), the context keeps it as `host_table`: a pipeline
        sends it to its stages with the step's message (each builds its context from it)
        instead of broadcasting the device tensors."""
        if self.group.error is not None:
            raise RuntimeError(f"the {self.group.label} group is closed: {self.group.error}")
        ctx = super().context(*args, **kw)
        ctx.host_table = kw.get("table")
        return ctx

    def copy_blocks(self, pairs) -> None:
        if pairs:
            with self.group.guard("copy-on-write"):
                self.group.send(("copy", [(int(s), int(d)) for s, d in pairs]))
        super().copy_blocks(pairs)


class RankZeroRunner(engine.ModelRunner):
    """Rank 0's runner over several ranks: layer 4's, whose host reads of sampled tokens wait at
    most the group's timeout (a worker that hangs mid-step stalls rank 0's GPU inside a
    collective; a plain .tolist() would wait for ever)."""

    group = None

    def sample(self, logits, params, generators) -> list[int]:
        if not len(params) or self.group is None:
            return super().sample(logits, params, generators)
        tokens = self.sample_tokens(logits, params, generators)
        if tokens.is_cuda:
            event = torch.cuda.Event()
            event.record()
            wait_event(self.group, event, "sampling")
        return tokens.tolist()


def wait_event(group, event: torch.cuda.Event, what: str) -> None:
    """Wait for a CUDA event, checking the workers live; past the group's timeout the group
    fails (every worker stopped, its communicator aborted) with one error naming the ranks.

    Spins on the event for the first SPIN_S (a decode step's wait: the tokens are read the
    moment they land, as layer 4's event.synchronize() does), yielding the core and the GIL
    between polls (os.sched_yield: back at once when nothing else is ready); only then naps
    (time.sleep(0) sleeps the kernel's timer slack, ~50-60 us: a poll that napped from the
    start read every step's tokens that much late)."""
    if event.query():
        return
    with group.guard(what):
        start = time.monotonic()
        next_check, spin_until = start + CHECK_S, start + SPIN_S
        while not event.query():
            now = time.monotonic()
            if now >= next_check:
                group.check_alive()
                next_check = now + CHECK_S
                if now - start > group.timeout_s:
                    raise TimeoutError("the step's GPU work did not finish within "
                                       + limit_text(False, group.timeout_s)
                                       + " (a rank hangs mid-step?)")
            if now < spin_until:
                os.sched_yield()
            else:
                time.sleep(0)
