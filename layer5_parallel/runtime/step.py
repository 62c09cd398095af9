"""A step as rank 0 hands it to the workers: a small host message and one packed broadcast.

The host half (`step_message`, written once for all workers into the shared-memory ring,
shm_broadcast.py) holds the integers a worker needs to rebuild rank 0's AttentionContext: query
and sequence lengths, the block table's width, whether the step writes the cache, whether only
each sequence's last logits are wanted, and (pipeline) the micro-batch cuts and whether the
last stage sends back greedy token ids instead of logits. The device half (`pack_step`) is one
int64 tensor, token ids | slot_mapping | block_tables, broadcast from rank 0 over the process
group: under NCCL it never leaves the GPU.
"""
from __future__ import annotations

import torch

import layer4_algorithms as engine

from .comm import TPComm


def step_message(ctx, has_cache: bool, last_only: bool, cuts=None, greedy: bool = False,
                 table=None) -> tuple:
    """("step", query_lens, seq_lens, max_blocks, has_cache, last_only, cuts, greedy, table).
    table: the step's block table on the host, (rows (B, n), lengths (B,)) int32, for ranks
    that build their context from it (`host_context`) instead of taking the broadcast."""
    max_blocks = -1 if ctx.block_tables is None else int(ctx.block_tables.shape[1])
    return ("step", ctx.query_lens_host, ctx.seq_lens_host, max_blocks, has_cache, last_only,
            cuts, greedy, table)


def decode_message(seq_lens: list[int], table, greedy: bool) -> tuple:
    """step_message of a decode step (one new token a sequence, a cache, one micro-batch)
    from host values: seq_lens, and table = (rows (B, n), lengths (B,)) int32."""
    B = len(seq_lens)
    return ("step", (1,) * B, seq_lens, int(table[0].shape[1]), True, True, [(0, B)], greedy,
            table)


def host_context(msg: tuple, cache, device: torch.device, staging=None):
    """The AttentionContext of a step whose message carries its block table: the slots worked
    out on the host from the table as rank 0's cache did, everything to the device in one
    copy (staging: reusable pinned buffers). Needs no broadcast (a stage that takes no ids)."""
    _, qlens, slens = msg[:3]
    rows, lens = msg[8]
    context_lens = [s - q for q, s in zip(qlens, slens, strict=True)]
    return cache.context(qlens, context_lens, rows, staging=staging, table=(rows, lens))


def pack_step(input_ids: torch.Tensor, ctx) -> torch.Tensor:
    """The device half: ids (T,) | slot_mapping (T,) | block_tables (B * max_blocks,), int64."""
    parts = [input_ids.reshape(-1), ctx.slot_mapping]
    if ctx.block_tables is not None:
        parts.append(ctx.block_tables.reshape(-1))
    return torch.cat([p.to(torch.int64) for p in parts])


def unpack_step(msg: tuple, comm: TPComm, device: torch.device):
    """Receive the broadcast of a step announced by `msg` -> (input_ids, AttentionContext)."""
    _, qlens, slens, max_blocks = msg[:4]
    T, B = sum(qlens), len(qlens)
    payload = torch.empty(2 * T + max(max_blocks, 0) * B, dtype=torch.int64, device=device)
    comm.broadcast(payload)
    ids, slots = payload[:T], payload[T:2 * T]
    tables = None if max_blocks < 0 else payload[2 * T:].view(B, max_blocks)
    ctx = engine.executor.AttentionContext.build(
        qlens, [s - q for q, s in zip(qlens, slens, strict=True)], slots, block_tables=tables,
        device=device)
    return ids, ctx
