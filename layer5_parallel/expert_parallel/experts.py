"""Expert parallelism: each of N ranks holds E/N of an MoE block's experts and its own tokens.

One forward on every rank (x_local: this rank's T_r tokens, (T_r, D)):
1. route locally: the router is replicated, so each rank picks top-k experts for its tokens;
2. dispatch: one all-to-all (layer 2's, uneven splits) sends each (token, slot) assignment's
   hidden state to the rank owning its expert, with a second carrying (global token, slot,
   expert) so the owner can apply capacity exactly as the single-process block does — by
   (slot, global token) order over *all* ranks' tokens (ranks hold contiguous token ranges);
3. the owner runs its experts on what it received (dropped rows give zeros);
4. combine: the reverse all-to-all returns each result to the token's rank, which weighs it by
   the gate and sums the k results per token.
Communication per rank and layer: 2 all-to-alls of ~T_r * k * D elements (most leave the
rank: (N-1)/N of them when routing is uniform). The step waits for the busiest rank, so the
imbalance max/mean (`MoEStats`) is the slowdown over perfect balance.

Experts are split contiguously, sizes differing by at most one (E need not divide by N).
Every wait is bounded by the process group's timeout (layer 2's collectives pass it on).
"""
from __future__ import annotations

import torch

import layer4_algorithms as engine

from .moe import MoEBlock, MoEStats, admit, capacity_for, swiglu, top_k_gates

comm = engine.comm  # layer 2: all_to_all, ring_all_gather, ring_all_reduce


def expert_ranges(num_experts: int, world: int) -> list[tuple[int, int]]:
    """[(first, stop)] of the experts each rank owns: contiguous, sizes differ by <= 1."""
    if world < 1 or num_experts < world:
        raise ValueError(f"expert parallelism needs 1 <= ranks <= num_experts; got {world} ranks "
                         f"for {num_experts} experts (valid sizes: 1..{num_experts})")
    return [tuple(b) for b in comm.segment_bounds(num_experts, world)]


class ExpertParallelMoE:
    """This rank's share of an MoEBlock: the router (replicated) and experts [first, stop).

    `forward(x_local (T_r, D)) -> (y_local (T_r, D), MoEStats of the whole batch)`; every rank
    must call it at the same point (it communicates). Equal to MoEBlock on the concatenation
    of all ranks' tokens in rank order.
    """

    def __init__(self, block: MoEBlock, rank: int | None = None, world: int | None = None) -> None:
        self.rank = comm.rank() if rank is None else rank
        self.world = comm.world_size() if world is None else world
        self.ranges = expert_ranges(block.num_experts, self.world)
        self.first, self.stop = self.ranges[self.rank]
        self.num_experts, self.k, self.hidden = block.num_experts, block.k, block.hidden
        self.capacity_factor = block.capacity_factor
        self.router = block.router.detach()
        own = slice(self.first, self.stop)  # copies: the full block may be dropped after this
        self.w_gate = block.w_gate.detach()[own].clone()
        self.w_up = block.w_up.detach()[own].clone()
        self.w_down = block.w_down.detach()[own].clone()
        # owner rank of each expert, for sorting assignments by destination
        self.owner = torch.cat([torch.full((b - a,), r) for r, (a, b) in enumerate(self.ranges)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:
        p, k, E = self.world, self.k, self.num_experts
        # One small all-gather first: token counts, and what every rank was given, so a bad
        # input on one rank is a ValueError on every rank instead of a peer left waiting.
        ok = x.dim() == 2 and x.shape[-1] == self.hidden
        mine = [x.shape[0] if ok else 0, int(not ok), self.hidden, E, k]
        every = comm.ring_all_gather(torch.tensor(mine, dtype=torch.int64)).view(p, len(mine))
        bad = [r for r in range(p) if every[r, 1] or not torch.equal(every[r, 2:], every[0, 2:])]
        if bad:
            raise ValueError(f"ExpertParallelMoE: rank {bad[0]} of {p} got a bad input or a "
                             f"different block (here: x {tuple(x.shape)}, expected (tokens, "
                             f"{self.hidden}); [hidden, experts, k] per rank: "
                             f"{every[:, 2:].tolist()})")
        counts = every[:, 0]
        offsets = torch.cumsum(counts, 0) - counts  # first global token index of each rank
        total = int(counts.sum())

        experts, gates = top_k_gates(x @ self.router.T, k)  # (T_r, k) each
        token = torch.arange(x.shape[0]).unsqueeze(1).expand_as(experts).flatten()
        slot = torch.arange(k).expand_as(experts).flatten()
        expert = experts.flatten()
        by_dest = torch.argsort(self.owner[expert], stable=True)  # group rows by owner rank
        token, slot, expert = token[by_dest], slot[by_dest], expert[by_dest]
        splits = torch.bincount(self.owner[expert], minlength=p).tolist()

        # dispatch: hidden states, and (global token, slot, expert) for the capacity order
        meta = torch.stack([token + offsets[self.rank], slot, expert], dim=1)
        got_x = comm.all_to_all(x[token].contiguous(), splits)
        got_meta = comm.all_to_all(meta, splits)

        g_token, g_slot, g_expert = got_meta.unbind(1)
        capacity = capacity_for(total, E, k, self.capacity_factor)
        kept = admit(g_expert - self.first, g_slot * total + g_token, self.stop - self.first,
                     capacity)
        y = torch.zeros_like(got_x)
        for e in range(self.first, self.stop):
            rows = ((g_expert == e) & kept).nonzero().flatten()
            if rows.numel():
                i = e - self.first
                y[rows] = swiglu(got_x[rows], self.w_gate[i], self.w_up[i], self.w_down[i])

        # combine: results go back along the reverse routes, in the order they were sent
        source = torch.bucketize(g_token.contiguous(), offsets, right=True) - 1
        back = comm.all_to_all(y, torch.bincount(source, minlength=p).tolist())
        out = torch.zeros_like(x)
        out.index_add_(0, token, back * gates.flatten()[by_dest].unsqueeze(1))

        load = torch.bincount(expert, minlength=E).to(torch.float64)
        totals = comm.ring_all_reduce(torch.cat([load, (~kept).sum().reshape(1).double()]))
        stats = MoEStats([int(c) for c in totals[:E]], int(totals[E]), total * k, capacity)
        return out, stats

    __call__ = forward
