"""Layer 5's bench for expert and context parallelism, on gloo ranks of this machine's CPU.

`bench_expert_context()` returns (and `format_expert_context` prints):
* "ring": ring attention on N ranks vs full causal attention (torch SDPA) in one process, per
  sequence length: the largest error over all rows, and seconds (ring: the slowest rank's best
  of `repeats`; full: best of `repeats`). Causal work per rank, contiguous vs load-balanced.
* "moe": load imbalance of the tiny Mixtral- and Qwen-MoE-shaped models on random tokens:
  per capacity factor, the busiest expert's load over the mean (max/mean, averaged over
  layers, and the worst layer) and the fraction of assignments dropped; and whether the EP
  forward on N ranks gave the single-process logits.
* "engine": an MoE model through layer 4's engine, TP=1 vs expert-parallel on N ranks
  (moe_engine.py).
Random weights route far from uniformly; trained routers are pushed toward balance by an
auxiliary loss, so these numbers are an upper end, not a forecast for a trained model.
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F

import layer4_algorithms as engine

from ..context_parallel.ring_attention import causal_work, ring_attention, shard_sequence
from ..expert_parallel.model import MIXTRAL_TINY, QWEN_MOE_TINY, ExpertParallelModel, MoETransformer
from .moe_engine import bench_moe_engine, format_moe_engine

comm = engine.comm


def _ring_rank(seq_lens: list[int], heads: int, kv_heads: int, dim: int, repeats: int) -> list:
    """On every rank: ring attention per length; (S, max error, best seconds)."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the cores
    me, p = comm.rank(), comm.world_size()
    rows = []
    for S in seq_lens:
        g = torch.Generator().manual_seed(S)
        q = torch.randn(1, heads, S, dim, generator=g)
        k, v = (torch.randn(1, kv_heads, S, dim, generator=g) for _ in range(2))
        mine = [shard_sequence(t, me, p) for t in (q, k, v)]
        best = float("inf")
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            out = ring_attention(*mine, S)
            best = min(best, time.perf_counter() - start)
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        rows.append((S, float((out - shard_sequence(full, me, p)).abs().max()), best))
    return rows


def _ep_rank(seed: int, batch: int, seq: int) -> list[bool]:
    """On every rank: do the EP models' logits equal the single-process ones?"""
    me, p = comm.rank(), comm.world_size()
    same = []
    for config in (MIXTRAL_TINY, QWEN_MOE_TINY):
        model = MoETransformer(dataclasses.replace(config, capacity_factor=1.25), seed=seed)
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, config.vocab, (batch, seq), generator=g)
        a, b = comm.segment_bounds(batch, p)[me]
        got, _ = ExpertParallelModel(model)(tokens[a:b])
        with torch.no_grad():
            want, _ = model(tokens)
        same.append(bool(torch.allclose(got, want[a:b], rtol=1e-4, atol=1e-5)))
    return same


def moe_imbalance(batch: int = 8, seq: int = 64, seed: int = 0) -> list[dict]:
    """Routing statistics of the tiny models on random tokens, single-process (EP routes and
    drops exactly the same, as tests/layer5/test_moe.py checks)."""
    rows = []
    for name, config in (("mixtral-tiny (8 experts, top-2)", MIXTRAL_TINY),
                         ("qwen-moe-tiny (12 experts, top-4, shared)", QWEN_MOE_TINY)):
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, config.vocab, (batch, seq), generator=g)
        for cf in (None, 1.25, 1.0):
            model = MoETransformer(dataclasses.replace(config, capacity_factor=cf), seed=seed)
            with torch.no_grad():
                _, stats = model(tokens)
            ratios = [s.max_over_mean for s in stats]
            dropped = sum(s.dropped for s in stats) / sum(s.assignments for s in stats)
            rows.append(dict(model=name, capacity_factor=cf, tokens=batch * seq,
                             max_over_mean=sum(ratios) / len(ratios), worst_layer=max(ratios),
                             dropped=dropped,
                             tokens_per_expert_layer0=stats[0].tokens_per_expert))
    return rows


def bench_expert_context(world: int = 2, seq_lens: tuple[int, ...] = (512, 2048),
                         heads: int = 8, kv_heads: int = 2, dim: int = 64, repeats: int = 3,
                         timeout_s: float = 300.0) -> dict:
    """Run everything above; a dict of plain numbers (JSON-ready)."""
    rings = comm.launch(_ring_rank, world, list(seq_lens), heads, kv_heads, dim, repeats,
                        backend="gloo", timeout_s=timeout_s)
    ring = []
    torch.set_num_threads(1)  # as each rank had: a like-for-like core count
    for i, S in enumerate(seq_lens):
        g = torch.Generator().manual_seed(S)
        q = torch.randn(1, heads, S, dim, generator=g)
        k, v = (torch.randn(1, kv_heads, S, dim, generator=g) for _ in range(2))
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            best = min(best, time.perf_counter() - start)
        naive, balanced = causal_work(S, world, balanced=False), causal_work(S, world)
        ring.append(dict(seq_len=S, world=world, max_error=max(r[i][1] for r in rings),
                         ring_s=max(r[i][2] for r in rings), full_s=best,
                         work_max_over_min_contiguous=max(naive) / min(naive),
                         work_max_over_min_balanced=max(balanced) / min(balanced)))
    ep_same = comm.launch(_ep_rank, world, 0, 5, 16, backend="gloo", timeout_s=timeout_s)
    return dict(ring=ring, moe=moe_imbalance(), ep_equal_single_process=all(map(all, ep_same)),
                engine=bench_moe_engine(world), world=world, device="cpu (gloo ranks)")


def format_expert_context(result: dict) -> str:
    """The bench's result as two plain-text tables."""
    lines = [f"ring attention on {result['world']} gloo ranks vs full causal SDPA (one process)",
             f"{'S':>6} {'max err':>9} {'ring s':>8} {'full s':>8} {'work max/min contiguous':>24}"
             f" {'balanced':>9}"]
    for r in result["ring"]:
        lines.append(f"{r['seq_len']:>6} {r['max_error']:9.1e} {r['ring_s']:8.3f} "
                     f"{r['full_s']:8.3f} {r['work_max_over_min_contiguous']:24.2f} "
                     f"{r['work_max_over_min_balanced']:9.3f}")
    lines += ["", "MoE load imbalance on random tokens (random weights)",
              f"{'model':<42} {'cf':>5} {'max/mean':>9} {'worst':>6} {'dropped':>8}"]
    for m in result["moe"]:
        cf = "none" if m["capacity_factor"] is None else f"{m['capacity_factor']:g}"
        lines.append(f"{m['model']:<42} {cf:>5} {m['max_over_mean']:9.2f} {m['worst_layer']:6.2f}"
                     f" {m['dropped']:8.1%}")
    lines.append(f"EP forward equals single-process: {result['ep_equal_single_process']}")
    if "engine" in result:
        lines += ["", format_moe_engine(result["engine"])]
    return "\n".join(lines)
