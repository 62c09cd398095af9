"""An MoE model layer 4's engine serves (Mixtral / Qwen-MoE shape, random weights), and its
tensor- and expert-parallel shards.

`MoELlamaModel` is layer 3's `LlamaModel` — same forward(ids, ctx, cache), same attention,
paged KV, norms, RoPE, LM head — with every layer's MLP swapped for an `MoEMLP`: a router and
E SwiGLU experts (top-k, renormalised gates: moe.py's routing), plus Qwen-MoE's optional shared
expert (a dense SwiGLU scaled by a sigmoid gate). So `LLM(l3.Model(random_moe_model(cfg)))`
runs it with continuous batching like any dense model.

Under `LLM(model, tensor_parallel_size=N, enable_expert_parallel=True)` attention is TP-sharded
as for a dense model (tensor_parallel/shard.py) and each rank's MoEMLP holds E/N experts
(contiguous, sizes differing by at most one). Without the flag each expert's FFN is TP-sharded
instead (columns of gate/up, rows of down: every rank holds a 1/N slice of all E experts), as
vLLM does.

Why an all-reduce of partial outputs and not an all-to-all: under TP every rank already holds
all T tokens' hidden states after the attention all-reduce. Each rank routes all of them (the
router is replicated, so all ranks agree on every choice and every capacity drop), runs its own
experts on the tokens routed to them, and adds zeros for the rest; one all-reduce of (T, H) sums
the partials, the same single all-reduce a dense row-parallel MLP pays. Dispatching by
all-to-all would ship tokens to ranks that already have them. The all-to-all pays when ranks
hold *different* tokens — data-parallel attention + EP (`ExpertParallelModel`, DeepSeek-V3,
vLLM's DP+EP) — where it moves T_r·k·H per rank instead of T·H.

Load statistics: routing is replicated, so rank 0 sees every assignment: each MoEMLP counts
assignments per expert (before capacity) and drops, summed over the forwards since
`reset_expert_load`; `expert_load(llm)` reports them per layer and per rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

import layer4_algorithms as engine

from ..tensor_parallel.shard import split_bounds
from .moe import MoEStats, route

l3 = engine.executor


@dataclass(frozen=True)
class MoEModelConfig(l3.ModelConfig):
    """A ModelConfig whose MLPs are MoE: num_experts experts of moe_intermediate_size each,
    num_experts_per_tok (k) per token, capacity_factor None (no drops: inference) or a float,
    shared_expert_intermediate_size > 0 adds Qwen-MoE's shared expert. intermediate_size is
    unused (kept equal to moe_intermediate_size)."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..num_experts={self.num_experts}, "
                             f"got {self.num_experts_per_tok}")
        if self.moe_intermediate_size <= 0:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)


def moe_config(**kw) -> MoEModelConfig:
    """A small MoE config with awkward sizes (override any field): 6 experts, top-2, 8 query
    heads, 2 kv heads, vocab 211, expert FFN 36, 2 layers."""
    base = dict(model_type="qwen2", vocab_size=211, hidden_size=64, intermediate_size=36,
                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                qkv_bias=True, max_position_embeddings=128, num_experts=6, num_experts_per_tok=2,
                moe_intermediate_size=36)
    return MoEModelConfig(**(base | kw))


class MoEMLP(nn.Module):
    """forward(x (T, H), ops) -> (T, H): the routed experts' gate-weighted sum (+ the shared
    expert). Holds experts [first, first + local) of num_experts, each of FFN width `ffn`
    (a column slice when TP-sharded); comm (a TPComm) sums the ranks' partials, None alone."""

    def __init__(self, config: MoEModelConfig, *, first: int = 0, local: int | None = None,
                 ffn: int | None = None, shared_ffn: int | None = None, comm=None) -> None:
        super().__init__()
        H, E = config.hidden_size, config.num_experts
        self.num_experts, self.k = E, config.num_experts_per_tok
        self.capacity_factor = config.capacity_factor
        self.first, self.local = first, E if local is None else local
        F = config.moe_intermediate_size if ffn is None else ffn
        Fs = config.shared_expert_intermediate_size if shared_ffn is None else shared_ffn
        self.comm = comm
        self.router = nn.Linear(H, E, bias=False)  # replicated: every rank routes every token
        self.gate_up = nn.Parameter(torch.empty(self.local, 2 * F, H))  # [gate | up] per expert
        self.down = nn.Parameter(torch.empty(self.local, H, F))
        self.shared = config.shared_expert_intermediate_size > 0
        if self.shared:
            self.shared_gate_up = nn.Linear(H, 2 * Fs, bias=False)
            self.shared_down = nn.Linear(Fs, H, bias=False)
            self.shared_gate = nn.Linear(H, 1, bias=False)
        self.register_buffer("load", torch.zeros(E, dtype=torch.int64), persistent=False)
        self.register_buffer("dropped", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        routing = route(self.router(x), self.k, self.capacity_factor)
        self.load += torch.bincount(routing.experts.flatten(), minlength=self.num_experts)
        self.dropped += (~routing.kept).sum()
        e = routing.experts.flatten()
        weight = (routing.gates * routing.kept).flatten()
        mine = routing.kept.flatten() & (e >= self.first) & (e < self.first + self.local)
        rows = mine.nonzero().flatten()
        rows = rows[torch.argsort(e[rows], stable=True)]  # grouped by expert, token order within
        counts = torch.bincount(e[rows] - self.first, minlength=self.local).tolist()
        out = torch.zeros_like(x)
        for i, part in enumerate(rows.split(counts)):
            if part.numel():
                tok = part // self.k
                h = ops.silu_and_mul(x[tok] @ self.gate_up[i].T) @ self.down[i].T
                out.index_add_(0, tok, h * weight[part].unsqueeze(1).to(h.dtype))
        if self.shared:  # under TP a column/row slice: its partial joins the same all-reduce
            s = self.shared_down(ops.silu_and_mul(self.shared_gate_up(x)))
            out += torch.sigmoid(self.shared_gate(x)) * s
        return out if self.comm is None else self.comm.all_reduce(out)

    def tp_shard(self, config, rank: int, world: int, comm, *, expert_parallel: bool,
                 device: torch.device) -> MoEMLP:
        """Rank `rank`'s MoEMLP (tp.shard_model calls it for each layer): experts [first, stop)
        whole (expert_parallel) or every expert's FFN columns [f0, f1); the shared expert is
        always column/row sharded; the router is copied whole."""
        E, F = self.num_experts, self.down.shape[-1]
        if expert_parallel:
            if E < world:
                raise ValueError(f"enable_expert_parallel: {E} experts cannot be split over "
                                 f"{world} ranks (each needs at least one); valid sizes: "
                                 f"1..{E}")
            a, b = split_bounds(E, world, rank)
            f0, f1 = 0, F
        else:
            a, b = 0, E
            f0, f1 = split_bounds(F, world, rank)
        cols = torch.cat([self.gate_up[a:b, f0:f1], self.gate_up[a:b, F + f0:F + f1]], dim=1)
        down = self.down[a:b, :, f0:f1]
        s0, s1, Fs = 0, 0, 0
        if self.shared:
            Fs = self.shared_down.weight.shape[1]
            s0, s1 = split_bounds(Fs, world, rank)
        with l3.meta_device():
            out = MoEMLP(config, first=a, local=b - a, ffn=f1 - f0, shared_ffn=s1 - s0, comm=comm)
        state = {"router.weight": self.router.weight, "gate_up": cols, "down": down}
        if self.shared:
            gu = self.shared_gate_up.weight
            state |= {"shared_gate_up.weight": torch.cat([gu[s0:s1], gu[Fs + s0:Fs + s1]]),
                      "shared_down.weight": self.shared_down.weight[:, s0:s1],
                      "shared_gate.weight": self.shared_gate.weight}
        out.load_state_dict({k: v.detach().to(device).clone().contiguous()
                             for k, v in state.items()}, assign=True)
        return out.reset_counters(device).requires_grad_(False)

    def reset_counters(self, device=None) -> MoEMLP:
        """Zero the load counters (made anew on `device`: a model built on meta has none)."""
        device = self.router.weight.device if device is None else device
        self.load = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        self.dropped = torch.zeros((), dtype=torch.int64, device=device)
        return self


class MoELlamaModel(l3.LlamaModel):
    """Layer 3's LlamaModel with MoE MLPs (config: an MoEModelConfig). Same forward."""

    def __init__(self, config: MoEModelConfig, backend: str = "torch", *,
                 dropout: float = 0.0) -> None:
        if not isinstance(config, MoEModelConfig):
            raise TypeError(f"MoELlamaModel needs an MoEModelConfig, got {type(config).__name__}")
        super().__init__(config, backend, dropout=dropout)
        for layer in self.layers:
            layer.mlp = MoEMLP(config)


def random_moe_model(config: MoEModelConfig, *, seed: int = 0, std: float = 0.3,
                     dtype: torch.dtype = torch.float32, device=None,
                     backend: str = "torch") -> MoELlamaModel:
    """Random N(0, std / sqrt(fan_in / 64)) weights (norm weights 1), for tests and benchmarks."""
    g = torch.Generator().manual_seed(seed)
    with l3.meta_device():
        net = MoELlamaModel(config, backend=backend)
    state = {}
    for name, p in net.state_dict().items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(p.shape, dtype=dtype, device=device)
        else:
            scale = std / math.sqrt(max(1, p.shape[-1]) / 64) if p.dim() >= 2 else std
            state[name] = (torch.randn(p.shape, generator=g) * scale).to(device=device, dtype=dtype)
    net.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        net.lm_head.weight = net.embed.weight
    for layer in net.layers:
        layer.mlp.reset_counters(device)
    net.init_rope(device)
    return net.eval()


def _moe_layers(llm_or_net) -> list[MoEMLP]:
    net = getattr(getattr(llm_or_net, "runner", None), "net", llm_or_net)
    net = getattr(net, "shard", net)  # under TP: rank 0's shard (its routing is everyone's)
    return [m for m in net.modules() if isinstance(m, MoEMLP)]


def reset_expert_load(llm_or_net) -> None:
    """Zero the per-expert counters (e.g. after a warm-up)."""
    for m in _moe_layers(llm_or_net):
        m.reset_counters()


def expert_load(llm_or_net, ranks: int = 1) -> dict:
    """Load balance since the last reset, for an LLM (any TP/EP size) or a model.

    {"layers": [MoEStats per layer], "per_rank": [[assignments per rank] per layer] with the
    experts split over `ranks` as EP splits them, "max_over_mean": the busiest expert over the
    mean, "rank_max_over_mean": the busiest rank over the mean (the EP step's slowdown)}."""
    layers = _moe_layers(llm_or_net)
    if not layers:
        raise ValueError("expert_load: this model has no MoE layers")
    stats, per_rank = [], []
    for m in layers:
        load = m.load.tolist()
        n = sum(load)
        stats.append(MoEStats(load, int(m.dropped), n, -1))  # capacity: one per forward
        per_rank.append([sum(load[a:b]) for a, b in
                         (split_bounds(m.num_experts, ranks, r) for r in range(ranks))])

    def ratio(rows: list[list[int]]) -> float:
        vals = [max(r) / (sum(r) / len(r)) for r in rows if sum(r)]
        return sum(vals) / len(vals) if vals else 1.0

    return {"layers": stats, "per_rank": per_rank,
            "max_over_mean": ratio([s.tokens_per_expert for s in stats]),
            "rank_max_over_mean": ratio(per_rank)}



def check_expert_parallel(model, tp: int) -> None:
    """enable_expert_parallel needs an MoE model (a layer-3 Model whose net has MoE layers)
    with at least tp experts; ValueError naming the problem otherwise."""
    net = getattr(model, "net", None)
    config = getattr(net, "config", None)
    if not isinstance(config, MoEModelConfig):
        raise ValueError("enable_expert_parallel=True needs an MoE model (an l3.Model over "
                         "layer 5's MoELlamaModel, e.g. random_moe_model(moe_config())); "
                         "this model has no experts")
    if config.num_experts < tp:
        raise ValueError(f"enable_expert_parallel: {config.num_experts} experts cannot be split "
                         f"over tensor_parallel_size={tp} ranks; valid sizes: 1.."
                         f"{config.num_experts} (that also divide the heads)")
