"""Data parallelism: every rank holds the whole model and trains on its own slice of the batch.

After each backward the ranks average their gradients (an all-reduce) and so take the same
optimizer step. Done naively — backward, then one all-reduce per parameter — the network
idles during backward and the GPU idles during the all-reduces. DDP (Li et al., VLDB 2020)
fixes both:

- Buckets. Parameters are grouped, in the order backward produces their gradients (roughly
  the reverse of the forward), into buckets of about `bucket_bytes`; one all-reduce per
  bucket pays the per-message latency once per bucket instead of once per tensor.
- Overlap. A hook on each parameter fires when its gradient is accumulated; when the last
  gradient of a bucket arrives, that bucket's all-reduce is launched *asynchronously* while
  backward goes on computing earlier layers' gradients. `finish_gradients()` waits for the
  buckets still in flight (with a timeout) and writes the averages back into `.grad`.

    backward:  [layer L ...... layer 1 ...... layer 0]
    comm:             [bucket 0]   [bucket 1]   [bucket 2]   <- only the last one is exposed

Communication: `comm="torch"` launches torch.distributed.all_reduce(async_op=True) (gloo or
NCCL run it on their own threads); `comm="ours"` runs layer 2's ring all-reduce on one
background thread (buckets in launch order, so every rank issues them in the same order).

Inference replicas are data parallelism without gradients: each rank runs its own engine on
its share of the requests (`replica_share`); nothing is communicated at all, so throughput
scales with the number of replicas as long as there are requests to spread.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import layer4_algorithms as engine

COMMS = ("torch", "ours")


@dataclass
class Bucket:
    """Parameters whose gradients travel in one all-reduce, and the flat buffer they use."""

    params: list[nn.Parameter]
    buffer: torch.Tensor
    ready: int = 0
    handle: object = None
    launched: float = 0.0
    done: list[float] = field(default_factory=list)  # set from the comm thread when done


class DistributedDataParallel(nn.Module):
    """Wrap `module` for data-parallel training over the current process group.

    bucket_bytes: the target size of one all-reduce (a parameter larger than it gets a
    bucket of its own). average: divide the summed gradients by the world size (each rank's
    loss a mean over its own slice); False keeps the sum (each rank's loss already divided
    by the global token count, which is exact for uneven slices).
    Use: loss = ddp(...)...; loss.backward(); ddp.finish_gradients(); optimizer.step().
    """

    def __init__(self, module: nn.Module, *, bucket_bytes: int = 25 << 20, comm: str = "torch",
                 average: bool = True, timeout_s: float = 30.0) -> None:
        super().__init__()
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if comm not in COMMS:
            raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")
        self.module, self.comm, self.average, self.timeout_s = module, comm, average, timeout_s
        self.world = dist.get_world_size()
        params = [p for p in module.parameters() if p.requires_grad]
        with torch.no_grad():  # every replica starts from rank 0's weights
            for p in params:
                dist.broadcast(p.data, 0)
        self.buckets = _make_buckets(params[::-1], bucket_bytes)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="ddp-comm") if comm == "ours"
                      else None)
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        self.last_intervals: list[tuple[float, float]] = []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, p: nn.Parameter) -> None:
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        offset = 0
        for p in bucket.params:  # gather the bucket's gradients into its flat buffer
            n = p.numel()
            bucket.buffer[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n
        bucket.launched, bucket.done = time.perf_counter(), []
        if self.comm == "torch":
            bucket.handle = dist.all_reduce(bucket.buffer, async_op=True)
            bucket.handle.get_future().then(lambda _f, d=bucket.done: d.append(time.perf_counter()))
        else:
            bucket.handle = self._pool.submit(_ring_all_reduce, bucket.buffer, bucket.done)

    def finish_gradients(self) -> None:
        """Wait for every bucket (timeout_s each) and write the reduced gradients to .grad."""
        missing = [self._names.get(id(p), "?") for b in self.buckets for p in b.params
                   if b.ready < len(b.params) and p.grad is None]
        if missing:
            raise RuntimeError(f"DDP: no gradient reached {missing[:5]} (unused in the forward?); "
                               "every rank must produce a gradient for every parameter")
        for bucket in self.buckets:
            if bucket.handle is None:  # a parameter's hook fired twice or never: be explicit
                raise RuntimeError("DDP: a bucket was never launched; call backward once per step")
            self._wait(bucket)
            if self.average:
                bucket.buffer.div_(self.world)
            offset = 0
            for p in bucket.params:
                n = p.numel()
                p.grad.copy_(bucket.buffer[offset:offset + n].view_as(p.grad))
                offset += n
        self.last_intervals = [(b.launched, b.done[0] if b.done else time.perf_counter())
                               for b in self.buckets]
        for bucket in self.buckets:
            bucket.ready, bucket.handle = 0, None

    def _wait(self, bucket: Bucket) -> None:
        try:
            if self.comm == "torch":
                bucket.handle.wait(timeout=timedelta(seconds=self.timeout_s))
            else:
                bucket.handle.result(timeout=self.timeout_s)
        except Exception as exc:
            raise RuntimeError(f"DDP: a gradient all-reduce did not finish within "
                               f"{self.timeout_s:g} s (a rank died or diverged?): {exc}") from exc

    def close(self) -> None:
        """Remove the hooks and stop the comm thread."""
        for h in self._hooks:
            h.remove()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _ring_all_reduce(buffer: torch.Tensor, done: list[float]) -> None:
    engine.comm.ring_all_reduce(buffer, "sum")
    done.append(time.perf_counter())


def _make_buckets(params: Sequence[nn.Parameter], bucket_bytes: int) -> list[Bucket]:
    """Consecutive parameters, a bucket closed once it holds >= bucket_bytes."""
    groups: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        if groups[-1] and size + p.numel() * p.element_size() > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel() * p.element_size()
    return [Bucket(g, torch.zeros(sum(p.numel() for p in g), dtype=g[0].dtype,
                                  device=g[0].device)) for g in groups if g]


def overlap_fraction(intervals: Sequence[tuple[float, float]], backward_end: float) -> float:
    """The share of communication time (the union of the buckets' [launch, done]) that ran
    before backward ended, i.e. was hidden behind it. 1.0: fully hidden; 0.0: none."""
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    total = sum(e - s for s, e in merged)
    hidden = sum(max(0.0, min(e, backward_end) - s) for s, e in merged)
    return hidden / total if total > 0 else 0.0


def replica_share(items: Sequence, rank: int, world: int) -> list:
    """Inference replicas: rank `rank`'s share of the requests (round-robin, so each gets
    within one of len(items) / world)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
    return list(items[rank::world])
