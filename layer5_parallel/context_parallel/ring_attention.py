"""Ring attention: causal attention over a sequence split across N ranks (context parallelism).

A long prefill's activations and KV do not fit one device, and attention is quadratic in the
sequence: split the sequence. Each rank holds a piece of Q, K and V. K/V pieces travel round
the ring (send right, receive left) while each rank attends its Q to the piece it holds, so
after N steps every Q has seen every K/V and no rank ever held more than two K/V pieces.

The merge. Attention of q over keys split into blocks A and B is not the average of the two
partial results: each partial softmax was normalised by its own sum. Keep with each partial
output o_X its log-sum-exp l_X = log sum_j exp(s_j) over the block's scores; then
    l = logaddexp(l_A, l_B),   o = o_A exp(l_A - l) + o_B exp(l_B - l)
is exact (`merge_partial`, the step flash attention's online softmax does per tile).

Load balance under a causal mask. With the sequence in N contiguous pieces, rank N-1's queries
see every key and rank 0's see only their own: rank N-1 works ~2N-1 times as long and the
ring waits for it. Cut the sequence into 2N chunks and give rank r chunks r and 2N-1-r (one
early, one late): every rank then has the same number of visible (q, k) pairs (to rounding).

The exchange uses torch.distributed's isend/irecv posted before the step's compute, so the
next block crosses the link while this one is attended to (layer 2's collectives are blocking
calls, which would serialise the two); every wait is bounded by `timeout_s`.
"""
from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist

import layer4_algorithms as engine

comm = engine.comm


def chunk_positions(seq_len: int, world: int) -> list[torch.Tensor]:
    """Positions each rank holds: chunks r and 2N-1-r of 2N near-equal chunks, in order."""
    if world < 1 or seq_len < 0:
        raise ValueError(f"need world >= 1 and seq_len >= 0, got world={world}, seq_len={seq_len}")
    chunks = comm.segment_bounds(seq_len, 2 * world)
    return [torch.cat([torch.arange(*chunks[r]), torch.arange(*chunks[2 * world - 1 - r])])
            for r in range(world)]


def shard_sequence(x: torch.Tensor, rank: int, world: int, dim: int = -2) -> torch.Tensor:
    """Rank `rank`'s load-balanced share of x along `dim` (the sequence)."""
    return x.index_select(dim, chunk_positions(x.shape[dim], world)[rank].to(x.device))


def unshard_sequence(shards: list[torch.Tensor], dim: int = -2) -> torch.Tensor:
    """Inverse of shard_sequence: every rank's share -> the sequence in order."""
    seq_len = sum(s.shape[dim] for s in shards)
    order = torch.cat(chunk_positions(seq_len, len(shards)))
    return torch.cat(shards, dim).index_select(dim, torch.argsort(order).to(shards[0].device))


def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                    k_pos: torch.Tensor, scale: float | None = None,
                    causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one block of keys: (out (B, H, n, Dv) float32, lse (B, H, n)).

    q (B, H, n, D); k (B, Hkv, m, D), v (B, Hkv, m, Dv) with H a multiple of Hkv (GQA: query
    head h reads kv head h // (H / Hkv)); q_pos (n,), k_pos (m,) global positions for the
    causal mask. A query that sees no key of the block gets out 0 and lse -inf.
    """
    B, H, n, D = q.shape
    Hkv = k.shape[1]
    if H % Hkv or k.shape[-2] != v.shape[-2] or k.shape[-1] != D:
        raise ValueError(f"attention_block: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} do not fit (H must be a multiple of Hkv)")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qg = q.float().view(B, Hkv, H // Hkv, n, D)  # group the query heads sharing a kv head
    s = (qg @ k.float().unsqueeze(2).transpose(-1, -2)) * scale  # (B, Hkv, G, n, m)
    if causal and k_pos.numel() and q_pos.numel() and k_pos.max() > q_pos.min():
        s = s.masked_fill(k_pos.view(1, -1) > q_pos.view(-1, 1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, n); -inf where every key is masked
    # a finite floor: a fully masked row gives exp(-inf - floor) = 0, never NaN
    p = torch.exp(s - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min))
    out = p @ v.float().unsqueeze(2)  # (B, Hkv, G, n, Dv)
    return out.view(B, H, n, -1), lse.view(B, H, n)


def merge_partial(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                  block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge one block's partial attention into the running result, exactly (see the module
    docstring). out, block_out (..., n, Dv); lse, block_lse (..., n); -inf marks "no keys yet"."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # both -inf: stay 0
    a = torch.exp(lse - safe).unsqueeze(-1)
    b = torch.exp(block_lse - safe).unsqueeze(-1)
    return out * a + block_out * b, new


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, *,
                   causal: bool = True, scale: float | None = None,
                   timeout_s: float = 60.0) -> torch.Tensor:
    """This rank's share of causal attention over the whole sequence, by ring passing.

    q (B, H, n_r, D), k (B, Hkv, n_r, D), v (B, Hkv, n_r, Dv): this rank's load-balanced share
    (`shard_sequence`) of a sequence of `seq_len` tokens. Returns (B, H, n_r, Dv) in q's dtype,
    the rows of full attention at this rank's positions. Every rank must call it together.
    """
    me, p = comm.rank(), comm.world_size()
    positions = [pos.to(q.device) for pos in chunk_positions(seq_len, p)]
    n = positions[me].numel()
    if q.shape[-2] != n or k.shape[-2] != n or v.shape[-2] != n:
        raise ValueError(f"ring_attention: rank {me} of {p} holds {n} of {seq_len} positions, "
                         f"but q, k, v have {q.shape[-2]}, {k.shape[-2]}, {v.shape[-2]} rows")
    _agree(seq_len, q, k, v)
    B, H, _, _ = q.shape
    out = q.new_zeros((B, H, n, v.shape[-1]), dtype=torch.float32)
    lse = torch.full((B, H, n), float("-inf"), device=q.device)
    # k and v travel together as one message: (2, B, Hkv, rows, D) (Dv == D assumed for packing)
    if v.shape[-1] != k.shape[-1]:
        raise ValueError("ring_attention packs k and v together: they need the same head dim")
    kv = torch.stack([k, v]).contiguous()
    wait = timedelta(seconds=timeout_s)
    for step in range(p):
        owner = (me - step) % p  # whose positions the kv in hand holds
        pending = []
        if step < p - 1:  # post the next exchange first: it overlaps this step's compute
            nxt = kv.new_empty((*kv.shape[:3], positions[(owner - 1) % p].numel(), kv.shape[-1]))
            pending = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (me + 1) % p),
                                              dist.P2POp(dist.irecv, nxt, (me - 1) % p)])
        k_pos = positions[owner]
        if n and k_pos.numel() and (not causal or k_pos.min() <= positions[me].max()):
            o, lb = attention_block(q, kv[0], kv[1], positions[me], k_pos, scale, causal)
            out, lse = merge_partial(out, lse, o, lb)
        for work in pending:
            if not work.wait(wait):
                raise TimeoutError(f"ring_attention: rank {me} waited {timeout_s:g} s at step "
                                   f"{step} for rank {(me - 1) % p}'s K/V block")
        if pending:
            kv = nxt
    return out.to(q.dtype)


def _agree(seq_len: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Every rank checks that all ranks passed the same seq_len, head counts, head dims and
    dtype (one small all-gather), so a disagreement is a ValueError on every rank, not a
    receive of the wrong size or a hang."""
    dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    code = dtypes.index(q.dtype) if q.dtype in dtypes else len(dtypes)
    mine = torch.tensor([seq_len, q.shape[0], q.shape[1], k.shape[1], q.shape[-1], v.shape[-1],
                         code], dtype=torch.int64, device=q.device)
    every = comm.ring_all_gather(mine).view(-1, mine.numel()).cpu()
    odd = [r for r in range(every.shape[0]) if not torch.equal(every[r], every[0])]
    if odd:
        names = "seq_len, batch, heads, kv_heads, head_dim, v_dim, dtype#"
        raise ValueError(f"ring_attention: ranks disagree on ({names}): rank 0 has "
                         f"{every[0].tolist()}, rank {odd[0]} has {every[odd[0]].tolist()}")


def ring_attention_simulated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world: int, *,
                             causal: bool = True) -> torch.Tensor:
    """The same schedule with every rank in this process (for notebooks, benches and checking):
    full q (B, H, S, D), k, v (B, Hkv, S, D) -> (B, H, S, Dv), rank by rank, step by step."""
    S = q.shape[-2]
    positions = [pos.to(q.device) for pos in chunk_positions(S, world)]
    shards = []
    for r in range(world):
        qr = q.index_select(-2, positions[r])
        out = torch.zeros((*qr.shape[:-1], v.shape[-1]), device=q.device)
        lse = torch.full(qr.shape[:-1], float("-inf"), device=q.device)
        for step in range(world):
            kp = positions[(r - step) % world]
            o, lb = attention_block(qr, k.index_select(-2, kp), v.index_select(-2, kp),
                                   positions[r], kp, causal=causal)
            out, lse = merge_partial(out, lse, o, lb)
        shards.append(out.to(q.dtype))
    return unshard_sequence(shards)


def causal_work(seq_len: int, world: int, balanced: bool = True) -> list[int]:
    """Visible (q, k) pairs per rank under a causal mask: what each rank computes.
    balanced=False is the naive split into N contiguous pieces."""
    if balanced:
        held = chunk_positions(seq_len, world)
    else:
        held = [torch.arange(a, b) for a, b in comm.segment_bounds(seq_len, world)]
    return [int((pos + 1).sum()) for pos in held]
