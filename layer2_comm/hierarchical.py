"""Hierarchical all-reduce: fast links inside a node, few messages between nodes.

Ranks are grouped into "nodes" of `ranks_per_node` consecutive ranks (the last node may be
smaller); the first rank of each node is its leader. Inside a node GPUs talk over NVLink
(high bandwidth, low latency); between nodes over a network that is several times slower.
A flat ring over all p ranks would push 2(p-1)/p * n bytes through every rank's network
link; the hierarchy sends only the leaders' share over the network.

1. Reduce inside each node onto its leader (binomial tree, ceil(log2 m) steps for m ranks
   per node):                          ceil(log2 m) (alpha_in + n beta_in)
2. All-reduce among the L = p/m leaders with the ring:
                                       2(L-1) alpha_out + 2(L-1)/L * n beta_out
3. Broadcast inside each node from its leader (binomial tree):
                                       ceil(log2 m) (alpha_in + n beta_in)

Only leaders touch the slow network, each sending 2(L-1)/L * n bytes — the same as a flat
ring over L ranks instead of p. NCCL does better still (every rank of a node drives its
own network card: a reduce-scatter inside the node, L-way rings in parallel, then an
all-gather), but the three phases here show the idea. Phases are built from point-to-point
messages within explicit rank lists, so no extra process groups are created.
(n counts bytes; alpha is per-message latency, beta seconds per byte.)
"""
from __future__ import annotations

import torch

from . import group, tuning
from .p2p import agree, check_op, flat, ring_neighbours, segment_bounds, write_back
from .ring import all_gather_stage, reduce_scatter_stage, run_pipeline
from .tree import binomial_broadcast, binomial_peers, binomial_reduce


def node_layout(world: int, ranks_per_node: int) -> list[list[int]]:
    """The ranks of each node: [[0..m-1], [m..2m-1], ...]; the last may be shorter."""
    return [list(range(s, min(s + ranks_per_node, world))) for s in range(0, world, ranks_per_node)]


def hierarchical_all_reduce(
    tensor: torch.Tensor, ranks_per_node: int, op: str = "sum"
) -> torch.Tensor:
    """Reduce `tensor` across all ranks in place: within nodes, across leaders, back down."""
    check_op(op, tensor.dtype)
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
    p, me = group.world_size(), group.rank()
    nodes = node_layout(p, ranks_per_node)
    members = nodes[me // ranks_per_node]
    leaders = [node[0] for node in nodes]
    work = flat(tensor)

    # One header round with everyone I will talk to: my tree parent and children in the
    # node, and, for leaders, their ring neighbours.
    parent, children = binomial_peers(len(members), members.index(me), 0)
    peers = [members[c] for c in children] + ([] if parent is None else [members[parent]])
    if me in leaders:
        peers += list(ring_neighbours(leaders, me))
    pieces = tuning.current().pieces(-(-work.numel() // len(leaders)) * work.element_size())
    agree("hierarchical_all_reduce", work, peers, op=op,
          params=[("ranks_per_node", ranks_per_node), ("pieces", pieces)])

    summed = "sum" if op == "avg" else op
    binomial_reduce(work, summed, members, 0)
    if me in leaders and len(leaders) > 1:  # the same pipelined ring as ring_all_reduce
        bounds = segment_bounds(work.numel(), len(leaders))
        run_pipeline([reduce_scatter_stage(work, summed, leaders, bounds, pieces),
                      all_gather_stage(work, leaders, bounds, pieces)], depth=pieces)
    if me in leaders and op == "avg":
        work.div_(p)
    binomial_broadcast(work, members, 0)
    return write_back(tensor, work)
