"""Pipeline parallelism for training: layers cut into stages, micro-batches flowing through.

Rank s of p holds stage s: a contiguous run of decoder layers (stage 0 also the embedding,
stage p-1 also the final norm, LM head and loss). A training step cuts the batch into m
micro-batches and walks this stage's schedule (schedules.py):

    F i: receive the stream (train_adapter) of micro-batch i from stage s-1 (stage 0 embeds ids),
         run the stage's layers, send the stream on to stage s+1 (the last stage: the loss)
    B i: receive d(loss)/d(stream) from stage s+1 (the last stage starts from its loss),
         backpropagate through the stage, send d(loss)/d(input stream) back to stage s-1

Every micro-batch's loss is its summed token cross-entropy over the *whole* batch's token
count, so the gradients the stages accumulate are exactly the full batch's. Sends are
non-blocking (isend) and waited for at the end; every receive waits at most `timeout_s`.
A tied embedding / LM head lives on the first and last stage: their two gradient halves are
swapped and added after the schedule, as Megatron does.

The step records, per rank, when each op's compute ran (`events`, time.perf_counter: one
clock for every process of a machine), so the bubble can be measured and drawn.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from .. import train_adapter as A
from ..split import even_ranges
from .schedules import schedule

SCHEDULE_IDS = {"gpipe": 0, "1f1b": 1}
GRAD_TAG = 1 << 16  # gradient messages' tags: kept apart from activations' (tag = micro-batch)


@dataclass
class PipelineResult:
    """One rank's view of a pipelined step. loss: the batch's mean loss (last stage only).
    events: (kind "F"/"B", micro-batch, start, end) of this rank's compute, perf_counter s."""

    stage: int
    stages: int
    loss: float | None
    events: list[tuple[str, int, float, float]] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0

    @property
    def busy_s(self) -> float:
        return sum(e - s for _, _, s, e in self.events)


def partition(num_layers: int, stages: int) -> list[range]:
    """Decoder layers per stage, as even as possible (earlier stages get the extra ones)."""
    if stages < 1 or stages > num_layers:
        raise ValueError(f"{stages} stages for {num_layers} layers: need 1 <= stages <= layers")
    return even_ranges(num_layers, stages)


def stage_units(num_layers: int, stage: int, stages: int) -> list[int]:
    """The units (0 = embed, 1..L = layers, L+1 = head; see train_adapter) stage `stage` runs."""
    units = [i + 1 for i in partition(num_layers, stages)[stage]]
    if stage == 0:
        units = [0] + units
    if stage == stages - 1:
        units = units + [num_layers + 1]
    return units


def stage_params(model: nn.Module, stage: int, stages: int) -> list[nn.Parameter]:
    """The parameters stage `stage` trains (each once)."""
    seen, out = set(), []
    for unit in stage_units(len(model.layers), stage, stages):
        for p in A.unit_params(model, unit):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def keep_stage(model: nn.Module, stage: int, stages: int) -> int:
    """Free every parameter stage `stage` does not run, as a rank that loaded only its own
    layers would hold; returns the parameter bytes kept."""
    mine = {id(p) for p in stage_params(model, stage, stages)}
    kept = 0
    for p in model.parameters():
        if id(p) in mine:
            kept += p.numel() * p.element_size()
        else:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return kept


def _wait(work, what: str, timeout_s: float) -> None:
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise RuntimeError(f"pipeline: {what} did not complete within {timeout_s:g} s "
                           f"(a stage died or runs a different schedule?): {exc}") from exc


def pipeline_step(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor, *,
                  micro_batches: int, schedule_name: str = "1f1b",
                  timeout_s: float = 30.0) -> PipelineResult:
    """Forward and backward of one batch, pipelined over all ranks of the process group.

    ids, targets: (B, T) int64, the same on every rank (only stages 0 and p-1 read them),
    B >= micro_batches (micro-batches may differ in size by one row). Leaves each parameter
    of this rank's stage with its full-batch gradient in .grad (accumulated: zero them first).
    """
    stage, stages = dist.get_rank(), dist.get_world_size()
    if ids.shape != targets.shape or ids.dim() != 2:
        raise ValueError(f"ids and targets must both be (B, T); got {tuple(ids.shape)}, "
                         f"{tuple(targets.shape)}")
    if not 1 <= micro_batches <= ids.shape[0]:
        raise ValueError(f"micro_batches must be in 1..B={ids.shape[0]}, got {micro_batches}")
    ops = schedule(schedule_name, stage, stages, micro_batches)
    units = stage_units(len(model.layers), stage, stages)
    ids_mb, tgt_mb = ids.tensor_split(micro_batches), targets.tensor_split(micro_batches)
    total = ids.numel()
    first, last = stage == 0, stage == stages - 1
    saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    sends, loss_sum = [], 0.0
    result = PipelineResult(stage, stages, None)
    _agree(stage, stages, [micro_batches, SCHEDULE_IDS[schedule_name], *ids.shape],
           model.device, timeout_s)
    result.start = time.perf_counter()
    for op in ops:
        i = op.micro
        if op.kind == "F":
            inp = None
            if not first:
                inp = torch.empty(A.stream_shape(model, *ids_mb[i].shape), dtype=model.dtype,
                                  device=model.device)
                _wait(dist.irecv(inp, stage - 1, tag=i), f"stage {stage} receiving F{i}", timeout_s)
                inp.requires_grad_()
            t0 = time.perf_counter()
            out = ids_mb[i] if first else inp
            for unit in units:
                out = A.run_unit(model, unit, out, tgt_mb[i], total)
            result.events.append(("F", i, t0, time.perf_counter()))
            saved[i] = (inp, out)
            if last:
                loss_sum += out.item()
            else:
                sends.append(dist.isend(out.detach(), stage + 1, tag=i))
        else:
            inp, out = saved.pop(i)
            grad = None
            if not last:
                grad = torch.empty_like(out)
                _wait(dist.irecv(grad, stage + 1, tag=GRAD_TAG + i),
                      f"stage {stage} receiving B{i}", timeout_s)
            t0 = time.perf_counter()
            torch.autograd.backward(out, grad)
            result.events.append(("B", i, t0, time.perf_counter()))
            if not first:
                sends.append(dist.isend(inp.grad, stage - 1, tag=GRAD_TAG + i))
    for work in sends:
        _wait(work, f"stage {stage} sending", timeout_s)
    if model.config.tie_word_embeddings and stages > 1 and (first or last):
        _sum_tied_grad(model.embed.weight, 0 if last else stages - 1, timeout_s)
    result.end = time.perf_counter()
    result.loss = loss_sum if last else None
    return result


def _agree(stage: int, stages: int, settings: list[int], device: torch.device,
           timeout_s: float) -> None:
    """All stages swap (micro-batches, schedule, B, T) before any activation moves: stages
    that disagree would post receives of the wrong size (gloo aborts the process on that),
    so they raise ValueError here instead, every one of them. Also aligns the start times."""
    mine = torch.tensor(settings, dtype=torch.int64, device=device)  # NCCL: on the GPU
    everyone = [torch.empty_like(mine) for _ in range(stages)]
    _wait(dist.all_gather(everyone, mine, async_op=True), f"stage {stage} meeting the others",
          timeout_s)
    table = [t.tolist() for t in everyone]
    if any(row != table[0] for row in table):
        names = "micro_batches, schedule, B, T"
        raise ValueError(f"pipeline stages disagree on ({names}): "
                         + "; ".join(f"stage {s}: {row}" for s, row in enumerate(table)))


def _sum_tied_grad(weight: nn.Parameter, peer: int, timeout_s: float) -> None:
    """First and last stage each hold half of a tied matrix's gradient: swap and add."""
    mine = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    theirs = torch.empty_like(mine)
    works = [dist.isend(mine.clone(), peer, tag=GRAD_TAG - 1),
             dist.irecv(theirs, peer, tag=GRAD_TAG - 1)]
    for work in works:
        _wait(work, "swapping the tied embedding's gradient", timeout_s)
    weight.grad = mine + theirs


def bubble_stats(results: list[PipelineResult]) -> dict:
    """Measured idle fraction per rank over the step's span (first start to last end on any
    rank) next to the formula (p-1)/(m+p-1). results: every rank's PipelineResult."""
    start = min(r.start for r in results)
    end = max(r.end for r in results)
    span = end - start
    idle = [1.0 - r.busy_s / span for r in results]
    micro = len({e[1] for e in results[0].events})
    p = len(results)
    return {"stages": p, "micro_batches": micro, "span_s": span, "idle_per_rank": idle,
            "idle_measured": sum(idle) / p, "idle_formula": (p - 1) / (micro + p - 1)}
