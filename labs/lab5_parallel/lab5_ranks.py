"""Programs that lab5.ipynb runs on every rank (read, no need to edit).

`launch(fn, p, *args)` starts p fresh Python processes, each of which imports `fn` by name: a
function defined in a notebook cell cannot travel to them, so the notebook's rank programs
live here. Each takes `impl`, the module whose exercise answers to run — "exercises" (your
work) or "layer5_parallel" (the reference) — and imports it inside the rank.
"""
from __future__ import annotations

import importlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import layer5_parallel as l5


def run(fn, world: int, *args, timeout_s: float = 120.0) -> list:
    """launch(fn, world, *args) on gloo ranks of this CPU; each rank's return value."""
    return l5.engine.executor.comm.launch(fn, world, *args, backend="gloo", timeout_s=timeout_s)


def _shard(n: int, world: int, rank: int) -> slice:
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def tp_mlp(impl: str, seed: int, tokens: int = 8, d: int = 12, hidden: int = 30) -> dict:
    """Column-parallel W1, GELU, row-parallel W2 with your f/g; compared with one process doing
    the whole MLP: the largest error in the output and in each gradient, and shard sizes."""
    ex = importlib.import_module(impl)
    me, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    x, dy = torch.randn(tokens, d, generator=g), torch.randn(tokens, d, generator=g)
    w1, w2 = torch.randn(hidden, d, generator=g), torch.randn(d, hidden, generator=g)
    full = [t.clone().requires_grad_() for t in (x, w1, w2)]
    want = F.gelu(full[0] @ full[1].T) @ full[2].T
    (want * dy).sum().backward()
    s = _shard(hidden, p, me)
    mine = [t.clone().requires_grad_() for t in (x, w1[s], w2[:, s])]
    got = ex.row_parallel_linear(F.gelu(ex.column_parallel_linear(mine[0], mine[1])), mine[2])
    (got * dy).sum().backward()

    def err(a, b):
        return float((a - b).detach().abs().max())

    return {"rank": me, "W1 rows": f"{s.start}:{s.stop}", "out": err(got, want),
            "dx": err(mine[0].grad, full[0].grad), "dW1": err(mine[1].grad, full[1].grad[s]),
            "dW2": err(mine[2].grad, full[2].grad[:, s])}


def ring_vs_full(seed: int, seq_len: int, heads: int = 4, kv_heads: int = 2, dim: int = 32,
                 repeats: int = 3) -> dict:
    """The layer's ring attention on this rank's load-balanced share vs full causal attention
    (torch SDPA) of the whole sequence: largest error on this rank's rows, and seconds."""
    ra = importlib.import_module("layer5_parallel.context_parallel.ring_attention")
    me, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, seq_len, dim, generator=g)
    k, v = (torch.randn(1, kv_heads, seq_len, dim, generator=g) for _ in range(2))
    shard = [ra.shard_sequence(t, me, p) for t in (q, k, v)]
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        out = ra.ring_attention(*shard, seq_len)
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    full_s = time.perf_counter() - start
    err = float((out - ra.shard_sequence(full, me, p)).abs().max())
    return {"rank": me, "rows": shard[0].shape[-2], "max error": err, "ring s": min(times),
            "full (one process) s": full_s}
