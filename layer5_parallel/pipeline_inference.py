"""Micro-batched pipeline inference: a forward-only pipeline over the same stages.

Serving a model too big for one device on p stages: a batch of prompts is cut into m
micro-batches that flow through the stages one after another, so stage s works on
micro-batch i while stage s+1 works on i-1. Without a backward the schedule is just
F0 F1 ... F(m-1) on every stage, and the bubble is the same (p-1)/(m+p-1) of the span, paid
at the start (later stages wait) and at the end (earlier stages are done). Each request still
crosses all p stages, so pipelining adds throughput, never latency: a lone request takes as
long as on one device plus p-1 hand-offs. (This is a full forward with no KV cache, over the
training path — the scoring half of serving. The engine itself, with a paged KV cache per
stage, micro-batches of each step and layer 4's scheduler on rank 0, is pp_engine.py.)
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from . import train_adapter as A
from .pipeline import PipelineResult, _agree, _wait, stage_units


@torch.no_grad()
def pipeline_forward(model: nn.Module, ids: torch.Tensor, *, micro_batches: int,
                     timeout_s: float = 30.0) -> tuple[torch.Tensor | None, PipelineResult]:
    """Logits of ids (B, T) through the stages: (B, T, V) fp32 on the last stage, None on
    the others, and this rank's timings (events are ("F", micro-batch, start, end))."""
    stage, stages = dist.get_rank(), dist.get_world_size()
    if ids.dim() != 2 or not 1 <= micro_batches <= ids.shape[0]:
        raise ValueError(f"ids must be (B, T) with 1 <= micro_batches <= B; got "
                         f"{tuple(ids.shape)}, micro_batches={micro_batches}")
    units = stage_units(len(model.layers), stage, stages)
    head = A.num_units(model) - 1
    first, last = stage == 0, stage == stages - 1
    result = PipelineResult(stage, stages, None)
    _agree(stage, stages, [micro_batches, -1, *ids.shape], model.device, timeout_s)
    result.start = time.perf_counter()
    sends, logits = [], []
    for i, piece in enumerate(ids.tensor_split(micro_batches)):
        out = piece
        if not first:
            out = torch.empty(A.stream_shape(model, *piece.shape), dtype=model.dtype,
                              device=model.device)
            _wait(dist.irecv(out, stage - 1, tag=i), f"stage {stage} receiving F{i}", timeout_s)
        t0 = time.perf_counter()
        for unit in units:
            if unit == head:
                out = A.head_logits(model, out).reshape(*piece.shape, -1)
            else:
                out = A.run_unit(model, unit, out, piece, piece.numel())
        result.events.append(("F", i, t0, time.perf_counter()))
        if last:
            logits.append(out)
        else:
            sends.append(dist.isend(out, stage + 1, tag=i))
    for work in sends:
        _wait(work, f"stage {stage} sending", timeout_s)
    result.end = time.perf_counter()
    return (torch.cat(logits) if last else None), result
