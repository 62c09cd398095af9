"""The collectives tensor parallelism needs, over a selectable backend.

A tensor-parallel forward uses three collectives, always over every rank of the group:
- all_reduce(x): the sum of every rank's x, in place (row-parallel outputs, the embedding);
- all_gather(x): every rank's (n, ...) stacked in rank order -> (world, n, ...) (the logits);
- broadcast(x): rank 0's x into every rank's x (the step's token ids and slots).

Backends:
- "torch": torch.distributed's own collectives (NCCL on GPUs, gloo on CPUs). The fast path.
- "ours": layer 2's collectives. On CPUs the ones built from send/recv (`ring_all_reduce`,
  `ring_all_gather`, `broadcast_tree`); each swaps a header with its peers first, so ranks
  that disagree on a tensor's size get a ValueError naming both instead of garbage or a hang.
  On GPUs layer 2's `PeerAllReduce` (one-shot / two-shot kernels over NVLink peer memory,
  capturable in CUDA graphs; NCCL above its max_bytes) does the all-reduces and the
  all-gather, and NCCL the step's broadcast.
`check=True` gives the torch backend the same guard: before each collective every rank
all-gathers (numel, dtype) and raises ValueError on a mismatch (one more small collective).

Both wait at most the process group's timeout.

Process groups: each tensor-parallel engine owns one (`new_group`): its own TCPStore (rank 0
hosts it on a port the OS picks) and its own gloo or NCCL backend object, outside
torch.distributed's default group, so several TP engines live in one process (`stack serve`
with two models). The "ours" backend is layer 2's collectives, which run over the default
group (`init()`, env://): an engine on it takes that group, one such engine per process.
"""
from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import layer4_algorithms as engine

COMM_BACKENDS = ("torch", "ours")
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int64: 3,
                torch.int32: 4, torch.float64: 5}


ABORT_S = 10.0  # the longest close() waits for an NCCL communicator's abort
# after a failure the abort may never finish (a stuck collective kernel, graphs that captured
# it still alive): wait only briefly, the abort goes on in its daemon thread
FAILED_ABORT_S = 1.0


def _abort(pg) -> None:
    try:
        pg.abort()
    except RuntimeError:
        pass


def new_group(backend: str, rank: int, world: int, port: int, timeout_s: float,
              store: dist.Store | None = None):
    """A process group of its own (not torch.distributed's default): a gloo or NCCL backend
    object over a TCPStore at 127.0.0.1:port (rank 0 passes the store it hosts). Blocks until
    every rank has joined, at most timeout_s. Returns (group, store)."""
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout), store
    if backend != "nccl":
        raise ValueError(f"process group backend must be gloo or nccl, got {backend!r}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # multicast off, as layer 2's init()
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world, opts), store


def host_store(world: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's TCPStore on a port the OS picks (store.port), waiting for no one yet."""
    return dist.TCPStore("127.0.0.1", 0, world, is_master=True,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def sub_group(store: dist.Store, key: str, backend: str, rank: int, size: int,
              timeout_s: float):
    """A process group over some of an engine's ranks (e.g. the tensor-parallel ranks of one
    pipeline stage): its own gloo or NCCL backend over a prefix `key` of the engine's TCPStore.
    rank, size: this process's place among the members. Every member calls it with the same
    key; the others never do."""
    return new_group(backend, rank, size, 0, timeout_s, store=dist.PrefixStore(key, store))[0]


class TPComm:
    """Collectives over `pg` (a group of its own, from new_group) or, when pg is None, over
    torch.distributed's default group ("ours" always uses the default group: layer 2's)."""

    def __init__(self, backend: str = "torch", *, check: bool = False, pg=None) -> None:
        if backend not in COMM_BACKENDS:
            raise ValueError(f"comm backend must be one of {COMM_BACKENDS}, got {backend!r}")
        if backend == "ours" and pg is not None:
            raise ValueError("the 'ours' backend runs layer 2's collectives over the default "
                             "process group; it takes no group of its own")
        self.backend, self.check, self.pg, self.closed = backend, check, pg, False
        if pg is None:
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world = pg.rank(), pg.size()
        # counted for the reports: calls, bytes, and host seconds inside collectives (the
        # time itself on gloo, which is synchronous; under NCCL only the time to queue them),
        # in total and per collective
        self.calls, self.bytes, self.seconds = 0, 0, 0.0
        self.peer = None  # "ours" on CUDA: layer 2's PeerAllReduce, made at the first call
        self.seconds_by = {"all_reduce": 0.0, "all_gather": 0.0, "broadcast": 0.0}

    def close(self, abort_wait_s: float = ABORT_S) -> None:
        """Drop this group (NCCL: abort its communicator, waiting at most abort_wait_s);
        collectives fail afterwards."""
        pg, self.closed = self.pg, True
        if self.peer is not None:
            self.peer.close()
            self.peer = None
        if pg is not None and hasattr(pg, "abort") and not isinstance(pg, dist.ProcessGroupGloo):
            # bounded: an abort waiting on a stuck device must not hang the engine's close
            done = threading.Thread(target=_abort, args=(pg,), daemon=True, name="nccl-abort")
            done.start()
            done.join(abort_wait_s)

    def _count(self, x: torch.Tensor) -> None:
        self.calls += 1
        self.bytes += x.numel() * x.element_size()

    def _agree(self, what: str, x: torch.Tensor) -> None:
        """ValueError on every rank when the ranks pass tensors of different numel or dtype.
        Not while a CUDA graph captures (it reads the answer on the host; the warm-up steps
        before the capture ran the same shapes through this check)."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        mine = torch.tensor([x.numel(), _DTYPE_CODES.get(x.dtype, 9)], dtype=torch.int64)
        if x.is_cuda:
            mine = mine.to(x.device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        if self.pg is None:
            dist.all_gather(every, mine)
        else:
            self.pg.allgather([every], [mine]).wait()
        rows = [tuple(t.tolist()) for t in every]
        if len(set(rows)) > 1:
            detail = ", ".join(f"rank {r}: numel {n} dtype code {d}"
                               for r, (n, d) in enumerate(rows))
            raise ValueError(f"{what}: ranks passed different tensors ({detail}); every rank of a "
                             "tensor-parallel group must run the same step on the same shapes")

    def _peer_for(self, x: torch.Tensor):
        """Layer 2's PeerAllReduce over the default group (collective: every rank makes it at
        its first CUDA collective, the same call on every rank)."""
        if self.peer is None:
            self.peer = engine.comm.PeerAllReduce(None, device=x.device)
        return self.peer

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        self._count(x)
        if self.backend == "ours" and x.is_cuda:
            peer = self._peer_for(x)
            return peer(x, out=x) if x.is_contiguous() else x.copy_(peer(x))
        if self.backend == "ours":
            return engine.comm.ring_all_reduce(x)
        if self.check:
            self._agree("all_reduce", x)
        if self.pg is None:
            dist.all_reduce(x)
        else:
            self.pg.allreduce([x]).wait()
        return x

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, ...) on every rank -> (world, n, ...), rank r's x at [r]."""
        self._count(x)
        x = x.contiguous()
        if self.backend == "ours" and x.is_cuda:
            return self._peer_for(x).all_gather(x).view(self.world, *x.shape)
        if self.backend == "ours":
            return engine.comm.ring_all_gather(x).view(self.world, *x.shape)
        if self.check:
            self._agree("all_gather", x)
        out = x.new_empty((self.world, *x.shape))
        if x.is_cuda:  # straight into one buffer: no per-rank copies (and capturable)
            if self.pg is None:
                dist.all_gather_into_tensor(out, x)
            else:
                self.pg._allgather_base(out, x).wait()  # noqa: SLF001 - all_gather_into_tensor
        elif self.pg is None:
            dist.all_gather(list(out.unbind(0)), x)
        else:
            self.pg.allgather([list(out.unbind(0))], [x]).wait()
        return out

    def _broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (same shape everywhere), in place; returns x."""
        self._count(x)
        if self.backend == "ours" and x.is_cuda:  # NCCL over the default group: capturable
            dist.broadcast(x, 0)
            return x
        if self.backend == "ours":
            return engine.comm.broadcast_tree(x, 0)
        if self.check:
            self._agree("broadcast", x)
        if self.pg is None:
            dist.broadcast(x, 0)
        else:
            self.pg.broadcast(x, 0).wait()
        return x

    def _timed(self, name: str, fn, x: torch.Tensor) -> torch.Tensor:
        if self.closed:
            raise RuntimeError(f"{name}: this tensor-parallel group is closed")
        start = time.perf_counter()
        try:
            return fn(x)
        finally:
            dt = time.perf_counter() - start
            self.seconds += dt
            self.seconds_by[name] += dt

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        return self._timed("all_reduce", self._all_reduce, x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, ...) on every rank -> (world, n, ...), rank r's x at [r]."""
        return self._timed("all_gather", self._all_gather, x)

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float, ops) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, h): h = (x summed over the ranks) + residual, y = rms_norm(h) * weight, for x,
        residual (T, H). With layer 2's all-reduce on GPUs one kernel (PeerAllReduce's
        all_reduce_rms_norm, which falls back to the two steps where it cannot fuse); else
        all_reduce(x) (in place) and then ops.rms_norm (layer 3's op set: the model's own)."""
        if self.backend == "ours" and x.is_cuda:
            def fused(t: torch.Tensor):
                self._count(t)
                return self._peer_for(t).all_reduce_rms_norm(t, residual, weight, eps)
            return self._timed("all_reduce", fused, x)
        return ops.rms_norm(self.all_reduce(x.contiguous()), weight, eps, residual)

    def gemv_all_reduce(self, x: torch.Tensor, w: torch.Tensor, silu: bool = False
                        ) -> torch.Tensor | None:
        """The sum over the ranks of x @ w^T (silu: of silu(gate) * up, x = [gate | up]), a
        row-parallel projection and its all-reduce, with layer 2's all-reduce on GPUs: its
        gemv_all_reduce, where it sends the GEMV's outputs to the peers from the GEMV's epilogue
        (PeerAllReduce.gemv_send on, sends_from_gemv). Elsewhere None: the caller runs its GEMV
        and all_reduce, as without the switch."""
        if (self.backend != "ours" or not x.is_cuda or not engine.comm.PeerAllReduce.gemv_send
                or not self._peer_for(x).sends_from_gemv(x, w, silu)):
            return None

        def fused(t: torch.Tensor):
            self.calls += 1
            self.bytes += t.shape[0] * w.shape[0] * t.element_size()
            return self._peer_for(t).gemv_all_reduce(t, w, silu)
        return self._timed("all_reduce", fused, x)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (same shape everywhere), in place; returns x."""
        return self._timed("broadcast", self._broadcast, x)

    def broadcast_start(self, x: torch.Tensor) -> list[tuple]:
        """Rank 0's side of broadcast(x) without waiting for the other ranks to take part:
        [(work, x)] to wait for later, or [] when it has finished already (layer 2's
        collectives, the default group, or check, whose shape check waits for everyone). A
        pipeline with steps in flight uses it: its later stages may still be computing earlier
        steps, and stage 0 should not wait for them to start its own (on GPUs .wait() would
        hold rank 0's stream until every rank joined)."""
        if self.backend == "ours" or self.pg is None or self.check:
            self.broadcast(x)
            return []
        self._count(x)
        return [(self.pg.broadcast(x, 0), x)]
