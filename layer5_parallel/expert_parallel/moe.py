"""A mixture-of-experts block, single-process: the reference expert parallelism must equal.

Each token picks k of E experts (Mixtral: k=2 of 8; Qwen-MoE: 4 of 60) and its output is the
gate-weighted sum of those experts' SwiGLU MLPs. Only k/E of the expert weights touch each
token, which is how an MoE model has many parameters but few FLOPs per token.

Routing (`route`): router logits (T, E) -> softmax over all E -> the top k probabilities per
token, renormalised to sum to 1 (Mixtral's gates; Qwen-MoE's with norm_topk_prob).

Capacity (GShard / Switch): each expert takes at most
    capacity = ceil(capacity_factor * T * k / E)
assignments per forward, so a batch whose tokens all pick one expert cannot make it (and
its rank) the straggler everyone waits for. Assignments are admitted first-choice-first
(all tokens' slot 0 in token order, then slot 1, ...), so a token loses its second expert
before anyone loses a first. A dropped assignment contributes nothing: the residual
connection around the block carries the token on. capacity_factor=None means no limit.

Everything here is decided by (slot, global token index) order alone, which is what lets
the expert-parallel form (experts.py) decide exactly the same drops on other ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Routing:
    """Where each token goes. T tokens, k slots each.

    experts: (T, k) int64, the chosen experts, best first.
    gates: (T, k) float, their weights (sum to 1 per token).
    kept: (T, k) bool, False where the assignment was dropped for capacity.
    capacity: the per-expert limit used (T * k when unlimited).
    """

    experts: torch.Tensor
    gates: torch.Tensor
    kept: torch.Tensor
    capacity: int


@dataclass
class MoEStats:
    """Load balance of one routing: tokens_per_expert counts assignments before capacity."""

    tokens_per_expert: list[int]
    dropped: int
    assignments: int
    capacity: int

    @property
    def max_over_mean(self) -> float:
        """The busiest expert's load over the mean load: 1.0 is perfect balance. The step
        takes as long as the busiest expert's rank, so this is the EP slowdown factor."""
        mean = sum(self.tokens_per_expert) / max(1, len(self.tokens_per_expert))
        return max(self.tokens_per_expert, default=0) / mean if mean else 1.0

    @property
    def dropped_fraction(self) -> float:
        return self.dropped / self.assignments if self.assignments else 0.0


def capacity_for(num_tokens: int, num_experts: int, k: int, capacity_factor: float | None) -> int:
    """Assignments one expert may take: ceil(cf * T * k / E), or T * k when cf is None."""
    if capacity_factor is None:
        return num_tokens * k
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive or None, got {capacity_factor}")
    return math.ceil(capacity_factor * num_tokens * k / num_experts)


def top_k_gates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits -> (experts (T, k), gates (T, k)): softmax, top k, renormalised."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"top-k needs 1 <= k <= num_experts={logits.shape[-1]}, got k={k}")
    probs = torch.softmax(logits.float(), dim=-1)
    gates, experts = torch.topk(probs, k, dim=-1)
    return experts, (gates / gates.sum(-1, keepdim=True)).to(logits.dtype)


def admit(experts: torch.Tensor, order: torch.Tensor, num_experts: int,
          capacity: int) -> torch.Tensor:
    """Which assignments fit: (n,) expert ids and (n,) priority keys (lower first) -> (n,) bool.

    Within each expert the `capacity` assignments with the lowest keys are kept.
    """
    kept = torch.zeros_like(experts, dtype=torch.bool)
    for e in range(num_experts):
        idx = (experts == e).nonzero().flatten()
        if idx.numel() > capacity:
            idx = idx[torch.argsort(order[idx], stable=True)[:capacity]]
        kept[idx] = True
    return kept


def route(logits: torch.Tensor, k: int, capacity_factor: float | None) -> Routing:
    """Top-k routing with capacity for (T, E) logits; see the module docstring."""
    T, E = logits.shape
    experts, gates = top_k_gates(logits, k)
    capacity = capacity_for(T, E, k, capacity_factor)
    if capacity_factor is None:  # no limit: nothing to admit (and no host sync per expert)
        return Routing(experts, gates, torch.ones_like(experts, dtype=torch.bool), capacity)
    slot = torch.arange(k, device=logits.device).expand(T, k)
    token = torch.arange(T, device=logits.device).unsqueeze(1).expand(T, k)
    order = (slot * T + token).flatten()  # slot 0 of every token first, then slot 1, ...
    kept = admit(experts.flatten(), order, E, capacity).view(T, k)
    return Routing(experts, gates, kept, capacity)


def stats_of(routing: Routing, num_experts: int) -> MoEStats:
    counts = torch.bincount(routing.experts.flatten(), minlength=num_experts)
    return MoEStats(counts.tolist(), int((~routing.kept).sum()), routing.kept.numel(),
                    routing.capacity)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
           w_down: torch.Tensor) -> torch.Tensor:
    """One expert: (n, D) -> (n, D) = (silu(x Wg^T) * x Wu^T) Wd^T; Wg, Wu (F, D), Wd (D, F)."""
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


class MoEBlock(nn.Module):
    """Router (E, D) and E SwiGLU experts stacked: w_gate, w_up (E, F, D), w_down (E, D, F).

    forward(x (..., D)) -> (y (..., D), Routing); random init unless weights are loaded.
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, k: int = 2,
                 capacity_factor: float | None = 1.25, *, dtype: torch.dtype = torch.float32,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"k must be in 1..num_experts={num_experts}, got {k}")
        self.hidden, self.ffn, self.num_experts, self.k = hidden, ffn, num_experts, k
        self.capacity_factor = capacity_factor

        def init(*shape: int, fan_in: int) -> nn.Parameter:
            w = torch.randn(*shape, generator=generator, dtype=torch.float32) / math.sqrt(fan_in)
            return nn.Parameter(w.to(dtype))

        self.router = init(num_experts, hidden, fan_in=hidden)
        self.w_gate = init(num_experts, ffn, hidden, fan_in=hidden)
        self.w_up = init(num_experts, ffn, hidden, fan_in=hidden)
        self.w_down = init(num_experts, hidden, ffn, fan_in=ffn)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        if x.shape[-1] != self.hidden:
            raise ValueError(f"MoEBlock expects (..., {self.hidden}), got {tuple(x.shape)}")
        flat = x.reshape(-1, self.hidden)
        routing = route(flat @ self.router.T, self.k, self.capacity_factor)
        out = torch.zeros_like(flat)
        weight = routing.gates * routing.kept  # dropped assignments weigh nothing
        for e in range(self.num_experts):
            tok, slot = ((routing.experts == e) & routing.kept).nonzero(as_tuple=True)
            if tok.numel():
                y = swiglu(flat[tok], self.w_gate[e], self.w_up[e], self.w_down[e])
                out.index_add_(0, tok, y * weight[tok, slot].unsqueeze(1))
        return out.view_as(x), routing
