"""`stack bench --layer 5`'s training part: pipeline bubble, DDP overlap, ZeRO memory.

bench_training(...) -> rows (dicts), each one measurement next to its model:
- "pipeline": idle fraction per schedule and micro-batch count, measured on gloo ranks
  (busy = the rank's forward/backward compute, span = the step's first start to last end
  on any rank) next to (p-1)/(m+p-1); a timeline PNG per run when out_dir is given.
- "ddp": the share of all-reduce time hidden behind backward, one bucket vs several.
- "zero": per-rank bytes of parameters, gradients and optimizer state for ZeRO-0..3,
  measured and by formula, and the activations saved with and without checkpointing.
- "checkpointing_cost": activations and fwd+bwd time with every layer checkpointed.
`format_training(rows)` prints them.
Ranks are processes with one thread each; on a machine with fewer cores than ranks the
times overlap and the bubble numbers mean little (the rows say how many cores there were).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import layer4_algorithms as engine

from .. import train_adapter as A
from ..data_parallel import checkpointing
from ..data_parallel.ddp import DistributedDataParallel, overlap_fraction
from ..data_parallel.memory import MemoryRow, format_table
from ..data_parallel.zero import ZeroTrainer
from ..pipeline_parallel.schedules import bubble_fraction
from ..pipeline_parallel.training import bubble_stats, pipeline_step
from .timeline import plot_rank_timelines

NAMES = {"gpipe": "GPipe", "1f1b": "1F1B"}
BENCH_SHAPE = dict(layers=4, hidden=256, heads=8, kv_heads=4, vocab=512, ffn=688)


def _pipeline_rank(cases: list[tuple[str, int]], rows_per_micro: int, seq_len: int) -> list:
    torch.set_num_threads(1)
    config = A.tiny_config(**BENCH_SHAPE)
    model = A.build_model(config, seed=0)
    out = []
    for sched, m in cases:
        ids, targets = A.random_batch(config, m * rows_per_micro, seq_len, seed=m)
        pipeline_step(model, ids, targets, micro_batches=m, schedule_name=sched)  # warm-up
        model.zero_grad(set_to_none=True)
        out.append(pipeline_step(model, ids, targets, micro_batches=m, schedule_name=sched))
        model.zero_grad(set_to_none=True)
    return out


def bench_pipeline(stages: int = 2, micro: tuple[int, ...] = (2, 4, 8), rows_per_micro: int = 2,
                   seq_len: int = 64, out_dir: str | Path | None = None,
                   timeout_s: float = 300.0) -> list[dict]:
    """Measured vs ideal bubble for GPipe and 1F1B at each micro-batch count."""
    cases = [(s, m) for s in ("gpipe", "1f1b") for m in micro]
    per_rank = engine.comm.launch(_pipeline_rank, stages, cases, rows_per_micro,
                                           seq_len, backend="gloo", timeout_s=timeout_s)
    rows = []
    for k, (sched, m) in enumerate(cases):
        results = [per_rank[r][k] for r in range(stages)]
        stats = bubble_stats(results)
        row = dict(part="pipeline", schedule=sched, stages=stages, micro_batches=m,
                   idle_measured=round(stats["idle_measured"], 3),
                   idle_per_rank=[round(x, 3) for x in stats["idle_per_rank"]],
                   idle_formula=round(bubble_fraction(stages, m), 3),
                   step_ms=round(stats["span_s"] * 1e3, 1), cores=os.cpu_count())
        if out_dir is not None:
            lanes = [r.events for r in results]
            paths = plot_rank_timelines(lanes, out_dir, f"pipeline_{sched}_p{stages}_m{m}",
                                        f"{NAMES[sched]}: {stages} stages, {m} micro-batches "
                                        f"(idle {stats['idle_measured']:.0%} measured, "
                                        f"{bubble_fraction(stages, m):.0%} ideal)")
            row["timeline"] = str(paths[0])
        rows.append(row)
    return rows


def _ddp_rank(bucket_sizes: list[int], rows: int, seq_len: int, repeats: int) -> list[dict]:
    torch.set_num_threads(1)
    config = A.tiny_config(**BENCH_SHAPE)
    out = []
    for bucket_bytes in bucket_sizes:
        model = A.build_model(config, seed=0)
        ddp = DistributedDataParallel(model, bucket_bytes=bucket_bytes)
        ids, targets = A.random_batch(config, rows, seq_len, seed=dist.get_rank())
        best = None
        for _ in range(repeats + 1):  # the first is a warm-up
            model.zero_grad(set_to_none=True)
            dist.barrier()
            loss = A.full_loss(model, ids, targets)
            t0 = time.perf_counter()
            loss.backward()
            t_bwd = time.perf_counter()
            ddp.finish_gradients()
            t_end = time.perf_counter()
            row = dict(bucket_bytes=bucket_bytes, buckets=len(ddp.buckets),
                       overlap=overlap_fraction(ddp.last_intervals, t_bwd),
                       backward_ms=(t_bwd - t0) * 1e3, exposed_comm_ms=(t_end - t_bwd) * 1e3)
            best = row if best is None or row["exposed_comm_ms"] < best["exposed_comm_ms"] else best
        ddp.close()
        out.append(best)
    return out


def bench_ddp(world: int = 2, bucket_sizes: tuple[int, ...] = (1 << 30, 1 << 20, 256 << 10),
              rows: int = 4, seq_len: int = 64, repeats: int = 3,
              timeout_s: float = 300.0) -> list[dict]:
    """DDP with one bucket (no overlap possible) vs smaller buckets (overlapped)."""
    per_rank = engine.comm.launch(_ddp_rank, world, list(bucket_sizes), rows, seq_len,
                                           repeats, backend="gloo", timeout_s=timeout_s)
    out = []
    for k in range(len(bucket_sizes)):
        r0 = per_rank[0][k]
        out.append(dict(part="ddp", world=world, **{key: (round(v, 3) if isinstance(v, float)
                                                          else v) for key, v in r0.items()},
                        cores=os.cpu_count()))
    return out


def _zero_rank(steps: int) -> list[dict]:
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    config = A.tiny_config(layers=2, hidden=64, heads=4, kv_heads=2, vocab=96, ffn=176)
    out = []
    for stage in (0, 1, 2, 3):
        trainer = ZeroTrainer(A.build_model(config, seed=0), stage)
        for s in range(steps):
            ids, targets = A.random_batch(config, 4, 16, seed=s)
            trainer.step(ids.tensor_split(world)[rank], targets.tensor_split(world)[rank],
                         ids.numel())
        row = trainer.memory_row()
        out.append(dict(stage=stage, psi=trainer.psi, label=row.label, params=row.params,
                        grads=row.grads, optimizer=row.optimizer, activations=row.activations,
                        formula=row.formula))
    return out


def bench_zero(world: int = 2, steps: int = 2, timeout_s: float = 300.0) -> list[dict]:
    """Rank 0's bytes under ZeRO-0..3 (fp32 Adam) next to the formula, plus checkpointing."""
    per_rank = engine.comm.launch(_zero_rank, world, steps, backend="gloo",
                                           timeout_s=timeout_s)
    rows = [dict(part="zero", world=world, **r,
                 states=r["params"] + r["grads"] + r["optimizer"],
                 states_formula=sum(r["formula"].values())) for r in per_rank[0]]
    config = A.tiny_config(layers=2, hidden=64, heads=4, kv_heads=2, vocab=96, ffn=176)
    model = A.build_model(config, seed=0)
    ids, targets = A.random_batch(config, 4 // world, 16, seed=0)  # one rank's slice
    for ckpt in (False, True):
        m = checkpointing.measure(model, ids, targets, ckpt)
        rows.append(dict(part="checkpointing", checkpointed=ckpt,
                         activations=m["activation_bytes"], step_ms=round(m["step_s"] * 1e3, 2)))
    return rows


def bench_checkpointing(rows: int = 2, seq_len: int = 128, repeats: int = 5) -> list[dict]:
    """Saved activations and forward+backward time with and without checkpointing every
    decoder layer, on the pipeline's bench shape (one process, one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = A.tiny_config(**BENCH_SHAPE)
        model = A.build_model(config, seed=0)
        ids, targets = A.random_batch(config, rows, seq_len, seed=0)
        out = [checkpointing.measure(model, ids, targets, ckpt, repeats) for ckpt in (False, True)]
    finally:
        torch.set_num_threads(threads)
    base = out[0]
    return [dict(part="checkpointing_cost", checkpointed=m["checkpointed"], tokens=rows * seq_len,
                 activations=m["activation_bytes"], step_ms=round(m["step_s"] * 1e3, 1),
                 activations_ratio=round(m["activation_bytes"] / base["activation_bytes"], 3),
                 time_ratio=round(m["step_s"] / base["step_s"], 3)) for m in out]


def zero_table(rows: list[dict]) -> str:
    """The ZeRO rows of bench_training as format_table's text table."""
    act = {r["checkpointed"]: r["activations"] for r in rows if r["part"] == "checkpointing"}
    table = [MemoryRow(r["label"], r["params"], r["grads"], r["optimizer"], r["activations"],
                       r["formula"]) for r in rows if r["part"] == "zero"]
    ddp = [row for row in table if row.label.startswith("DDP")]
    if act and ddp:  # the same DDP states, with every decoder layer checkpointed
        base = ddp[0]
        table.append(MemoryRow("DDP + checkpointing", base.params, base.grads, base.optimizer,
                               act[True], base.formula))
    return format_table(table)


def bench_training(out_dir: str | Path | None = None, *, stages: int = 2, world: int = 2,
                   quick: bool = False) -> list[dict]:
    """All three parts; quick=True shrinks them (for a smoke test)."""
    micro = (2, 4) if quick else (2, 4, 8)
    seq = 16 if quick else 64
    rows = bench_pipeline(stages, micro, seq_len=seq, out_dir=out_dir)
    rows += bench_ddp(world, seq_len=seq, repeats=1 if quick else 3)
    rows += bench_zero(world)
    rows += bench_checkpointing(seq_len=32 if quick else 128, repeats=2 if quick else 5)
    return rows


def format_training(rows: list[dict]) -> str:
    """bench_training's rows as text: bubble, overlap, ZeRO memory, checkpointing."""
    def part(name: str) -> list[dict]:
        return [r for r in rows if r["part"] == name]

    out = ["pipeline bubble (idle fraction of the step; measured vs (p-1)/(m+p-1)):"]
    out += [f"  {NAMES[r['schedule']]:<6} p={r['stages']} m={r['micro_batches']:<2} "
            f"measured {r['idle_measured']:.0%} (per rank "
            f"{', '.join(f'{x:.0%}' for x in r['idle_per_rank'])})  "
            f"formula {r['idle_formula']:.0%}  step {r['step_ms']:.0f} ms"
            for r in part("pipeline")]
    out.append("DDP (share of all-reduce time hidden behind backward):")
    out += [f"  {r['buckets']:>3} bucket(s) of <= {r['bucket_bytes'] / 2**20:g} MiB: "
            f"overlap {r['overlap']:.0%}, backward {r['backward_ms']:.0f} ms, "
            f"exposed comm {r['exposed_comm_ms']:.1f} ms" for r in part("ddp")]
    if part("zero"):
        out.append("ZeRO per-rank memory (fp32 Adam: 4 + 4 + 8 bytes per parameter):")
        out.append(zero_table(rows))
    out += [f"checkpointing={r['checkpointed']!s:<5} {r['tokens']} tokens: "
            f"activations {r['activations'] / 2**20:.2f} MiB (x{r['activations_ratio']}), "
            f"fwd+bwd {r['step_ms']} ms (x{r['time_ratio']})" for r in part("checkpointing_cost")]
    return "\n".join(out)
