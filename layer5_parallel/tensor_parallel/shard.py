"""Tensor parallelism (Megatron-style), applied from outside to a loaded layer-3 model.

`shard_model(net, rank, world, comm)` returns rank `rank`'s shard of a `LlamaModel`: a
`LlamaModel` of the same class and forward signature, built for a per-rank config (its
head counts and FFN width are this rank's), with four of its modules swapped:

    x (T, H), the same on every rank
    attention   qkv      column-parallel: rank r computes its Hq/p query heads and their
                         Hkv/p kv heads (q|k|v blocks of the merged weight, cut per block)
                o_proj   row-parallel: its input columns are rank r's heads; partial sums
                         (T, H) -> ALL-REDUCE (g) -> the full output on every rank
    mlp         gate_up  column-parallel: rows [f0, f1) of gate and of up (gate|up kept)
                down     row-parallel: columns [f0, f1) -> ALL-REDUCE (g)
    embed       vocab-parallel: rank r holds rows [v0, v1); ids outside are zero rows;
                         ALL-REDUCE fills them in
    lm_head     vocab-parallel: logits (T, V/p) -> ALL-GATHER -> (T, V)

Megatron's f and g: f is the identity in the forward pass (every rank already has x; in
training its backward is an all-reduce of the input gradients); g is the all-reduce after a
row-parallel layer (its backward is the identity). Inference needs only the forward: two
all-reduces per decoder layer, one for the embedding, one all-gather for the logits.

kv_heads < world: every rank still needs the kv head its query heads share, so the kv
heads are replicated (rank r takes kv head r * Hkv // world) and each rank's cache holds
one kv head. Valid sizes: world divides Hq, and Hkv % world == 0 or world % Hkv == 0.
The FFN width and the vocabulary may split unevenly (the vocab is padded to world * ceil(V /
world) rows, the padding's logits dropped after the gather).
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
from torch import nn

import layer4_algorithms as engine

from ..runtime.comm import TPComm


def valid_tp_sizes(config) -> list[int]:
    """Tensor-parallel sizes this model's heads allow (1 included)."""
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    return [p for p in range(1, hq + 1) if hq % p == 0 and (hkv % p == 0 or p % hkv == 0)]


def check_tp_size(config, world: int) -> None:
    """ValueError naming the valid sizes when `world` cannot split this model's heads."""
    sizes = valid_tp_sizes(config)
    if world not in sizes:
        raise ValueError(
            f"tensor_parallel_size={world} cannot split this model's {config.num_attention_heads} "
            f"query heads and {config.num_key_value_heads} kv heads evenly; valid sizes: "
            f"{', '.join(map(str, sizes))}")


def split_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's part of n items cut into world contiguous parts (sizes differ by
    at most one, the first n % world parts larger: torch.tensor_split's cut)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def kv_head_range(config, world: int, rank: int) -> tuple[int, int]:
    """[first, stop) of the kv heads rank holds (one replicated head when Hkv < world)."""
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    if hkv >= world:
        return rank * hkv // world, (rank + 1) * hkv // world
    first = rank * (hq // world) // (hq // hkv)  # the group of this rank's first query head
    return first, first + 1


def tp_config(config, world: int, rank: int):
    """The per-rank ModelConfig: this rank's query heads, kv heads and FFN width. Vocab and
    hidden size stay whole (the vocab-parallel modules hold their own slice)."""
    check_tp_size(config, world)
    k0, k1 = kv_head_range(config, world, rank)
    f0, f1 = split_bounds(config.intermediate_size, world, rank)
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // world,
                               num_key_value_heads=k1 - k0, intermediate_size=f1 - f0)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W_r^T) + b: x_r (T, in/p) is this rank's slice of the input
    features, W_r (out, in/p) the matching columns. The bias is added once, after the sum.
    reduce=False (set by defer_all_reduces): forward returns this rank's partial product and
    the norm after it (a ReducingRMSNorm) sums it over the ranks."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: TPComm) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.comm, self.reduce = comm, True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if not self.reduce:
            return y
        y = self.combine(y)  # g: the one all-reduce
        return y if self.bias is None else y + self.bias

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's partial product -> the sum over the ranks (layer 3's fused decode
        kernels call it after their GEMV, so a shard keeps the fused path)."""
        return self.comm.all_reduce(y)

    def gemv_combined(self, x: torch.Tensor, silu: bool) -> torch.Tensor | None:
        """The GEMV and its all-reduce as the comm's own (layer 3's fused decode kernels call
        it before their GEMV and combine): x (1, in/p), or [gate | up] with silu -> the sum
        over the ranks, or None where the comm has none (then layer 3's GEMV and combine)."""
        return self.comm.gemv_all_reduce(x, self.weight, silu)


class ReducingRMSNorm(nn.Module):
    """Layer 3's RMSNorm after a row-parallel projection that left its all-reduce to it:
    forward(x, ops, residual) sums x (this rank's partial product, (T, H)) over the ranks,
    adds the residual and normalises -> (y, h), as RMSNorm's forward over the summed x. With
    layer 2's all-reduce on GPUs that is one kernel (PeerAllReduce.all_reduce_rms_norm: the
    sum, the add and the norm in one launch, 64 launches fewer per 8B decode step); elsewhere
    the all-reduce and then ops.rms_norm. The fused decode kernels read only weight and eps
    (their projections reduce through `combine`)."""

    def __init__(self, norm: nn.Module, comm: TPComm) -> None:
        super().__init__()
        self.weight, self.eps, self.comm = norm.weight, norm.eps, comm

    def forward(self, x: torch.Tensor, ops, residual: torch.Tensor | None = None):
        if residual is None:  # layer 3's training path: its blocks add partial sums unreduced
            raise ValueError("a shard whose norms do the all-reduces (fused norms) runs the "
                             "serving forward only (a step with an AttentionContext); build it "
                             "with fuse_norms=False to train or score without a context")
        return self.comm.all_reduce_rms_norm(x, residual, self.weight, self.eps, ops)


#: Environment switch for defer_all_reduces in shard_model: "1" on, "0" off; unset: on where it
#: is one kernel (layer 2's all-reduce on CUDA). Measured on 4x H200 (8B shape, batch 32): TP=2
#: 1.43x -> 1.49x and 1.49x -> 1.62x TP=1's tokens/s, TP=4 1.99x -> 2.02x and 2.16x -> 2.17x
#: (two runs, each beside its own TP=1); batch 1 takes layer 3's fused GEMV path, unchanged.
FUSED_NORMS_ENV = "LLM_STACK_TP_FUSED_NORMS"


def fused_norms_default(comm: TPComm | None = None, device=None) -> bool:
    """Whether shard_model defers the all-reduces to the norms when not told: the switch if
    set, else whether `comm` runs layer 2's all-reduce on a CUDA `device`."""
    switch = os.environ.get(FUSED_NORMS_ENV)
    if switch is not None:
        if switch not in ("0", "1"):
            raise ValueError(f"{FUSED_NORMS_ENV} must be 0 or 1, got {switch!r}")
        return switch == "1"
    return (comm is not None and comm.backend == "ours" and device is not None
            and torch.device(device).type == "cuda")


def defer_all_reduces(shard, comm: TPComm) -> int:
    """Move the all-reduce of every bias-free row-parallel projection (o_proj, down) into the
    norm that follows it (the same layer's mlp_norm; the next layer's attn_norm, or the final
    norm after the last layer), which becomes a ReducingRMSNorm. Returns how many moved.
    The serving forward then computes what it did before; a layer whose MLP shards itself
    (MoE) keeps its reduction, and so does the next layer's attn_norm."""
    moved, layers = 0, shard.layers
    for i, layer in enumerate(layers):
        o_proj = layer.attn.o_proj
        if isinstance(o_proj, RowParallelLinear) and o_proj.bias is None:
            o_proj.reduce = False
            layer.mlp_norm = ReducingRMSNorm(layer.mlp_norm, comm)
            moved += 1
        down = getattr(layer.mlp, "down", None)
        if isinstance(down, RowParallelLinear) and down.bias is None:
            down.reduce = False
            after = layers[i + 1] if i + 1 < len(layers) else None
            if after is not None:
                after.attn_norm = ReducingRMSNorm(after.attn_norm, comm)
            else:
                shard.norm = ReducingRMSNorm(shard.norm, comm)
            moved += 1
    return moved


class VocabParallelEmbedding(nn.Module):
    """Rows [v0, v1) of the embedding (padded to `rows` rows): ids (T,) -> (T, H), the
    ids other ranks own looked up as zeros, then an all-reduce puts every row together.

    The rows sit in a table with one more row, of zeros, and `local` maps every token id of
    the vocabulary to its row here (ids this rank does not own: the zero row), so a lookup is
    two kernels (the map, the embedding) before the all-reduce, not a mask built from range
    tests, a shifted index and a fill (six more launches in every decode step). `weight` is
    the table without its zero row (the same memory: a tied LM head shares it)."""

    def __init__(self, table: torch.Tensor, v0: int, v1: int, comm: TPComm, vocab: int) -> None:
        """table: (rows + 1, H), rows [0, v1 - v0) this rank's tokens', the last row zeros."""
        super().__init__()
        rows = table.shape[0] - 1
        if rows < v1 - v0 or table[rows].any():
            raise ValueError(f"the embedding table needs {v1 - v0} rows and a last row of zeros, "
                             f"got {tuple(table.shape)}")
        self.register_buffer("table", table, persistent=False)
        self.weight = nn.Parameter(table[:rows], requires_grad=False)
        local = torch.full((vocab,), rows, dtype=torch.int64, device=table.device)
        local[v0:v1] = torch.arange(v1 - v0, device=table.device)
        self.register_buffer("local", local, persistent=False)
        self.v0, self.v1, self.comm = v0, v1, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(F.embedding(self.local[ids], self.table))


class VocabParallelLMHead(nn.Module):
    """x (..., H) -> this rank's (..., V_pad / p) logits -> all-gather -> (..., V)."""

    def __init__(self, weight: torch.Tensor, vocab: int, comm: TPComm) -> None:
        super().__init__()
        if not isinstance(weight, nn.Parameter):  # a tied head shares the embedding's Parameter
            weight = nn.Parameter(weight, requires_grad=False)
        self.weight = weight
        self.register_parameter("bias", None)  # as nn.Linear's: the fused kernels read it
        self.vocab, self.comm = vocab, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.combine(F.linear(x, self.weight))

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's (..., V_pad / p) logits -> every rank's, gathered: (..., V)."""
        parts = self.comm.all_gather(y)  # (p, ..., V_pad / p)
        return parts.movedim(0, -2).flatten(-2)[..., : self.vocab]


def _cols(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return t[:, a:b].contiguous()


def shard_model(net, rank: int, world: int, comm: TPComm, *, device=None,
                expert_parallel: bool = False, fuse_norms: bool | None = None):
    """Rank `rank`'s shard of `net` (a layer-3 LlamaModel, or a subclass such as expert_parallel's
    MoE model; left unchanged): a model of net's class on `device` (default net's) whose config
    has this rank's head counts and FFN width. An MLP with a `tp_shard` method (an MoE layer)
    shards itself: its experts split over the ranks (expert_parallel) or each expert's FFN.
    fuse_norms: each row-parallel all-reduce done by the norm after it (defer_all_reduces;
    serving only); None: fused_norms_default (on with layer 2's all-reduce on a GPU)."""
    c, device = net.config, torch.device(device or net.device)
    local = tp_config(c, world, rank)
    D, hq = c.head_dim, local.num_attention_heads
    k0, k1 = kv_head_range(c, world, rank)
    f0, f1 = split_bounds(c.intermediate_size, world, rank)
    q_rows = slice(rank * hq * D, (rank + 1) * hq * D)
    k_rows = slice(c.q_size + k0 * D, c.q_size + k1 * D)
    v_rows = slice(c.q_size + c.kv_size + k0 * D, c.q_size + c.kv_size + k1 * D)
    full = net.state_dict()
    state = {}
    skip = ("embed.", "lm_head.", *(f"layers.{i}.mlp." for i, layer in enumerate(net.layers)
                                     if hasattr(layer.mlp, "tp_shard")))
    for name, t in full.items():
        if name.startswith(skip):  # vocab-parallel below; MoE MLPs shard themselves
            continue
        if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
            t = torch.cat([t[q_rows], t[k_rows], t[v_rows]])  # q | k | v, this rank's heads
        elif name.endswith("mlp.gate_up.weight") or name.endswith("mlp.gate_up.bias"):
            F_ = c.intermediate_size
            t = torch.cat([t[f0:f1], t[F_ + f0:F_ + f1]])  # gate | up, this rank's columns of F
        elif name.endswith("attn.o_proj.weight"):
            t = _cols(t, q_rows.start, q_rows.stop)
        elif name.endswith("mlp.down.weight"):
            t = _cols(t, f0, f1)
        state[name] = t.to(device).clone()
    with engine.executor.meta_device():
        shard = type(net)(local, backend=net.backend)
    shard.load_state_dict(state, strict=False, assign=True)
    for layer, whole in zip(shard.layers, net.layers, strict=True):
        rows = [(layer.attn, "o_proj")]  # row-parallel: the all-reduce after o_proj and down
        if hasattr(whole.mlp, "tp_shard"):
            layer.mlp = whole.mlp.tp_shard(local, rank, world, comm,
                                           expert_parallel=expert_parallel, device=device)
        else:
            rows.append((layer.mlp, "down"))
        for parent, name in rows:
            lin = getattr(parent, name)
            setattr(parent, name, RowParallelLinear(lin.weight.data, None if lin.bias is None
                                                    else lin.bias.data, comm))
    V = c.vocab_size
    per = -(-V // world)
    v0, v1 = min(rank * per, V), min((rank + 1) * per, V)

    def vocab_rows(w: torch.Tensor, extra: int = 0) -> torch.Tensor:
        """(per + extra, H): this rank's rows, zero rows past the vocab (and the extra)."""
        out = torch.zeros(per + extra, w.shape[1], dtype=w.dtype, device=device)
        out[: v1 - v0] = w[v0:v1]
        return out

    emb = vocab_rows(full["embed.weight"], extra=1)  # the lookup's zero row last
    head = None if c.tie_word_embeddings else vocab_rows(full["lm_head.weight"])
    shard.embed = VocabParallelEmbedding(emb, v0, v1, comm, V)
    tied = c.tie_word_embeddings
    shard.lm_head = VocabParallelLMHead(shard.embed.weight if tied else head, V, comm)
    shard.init_rope(device)
    if fused_norms_default(comm, device) if fuse_norms is None else fuse_norms:
        defer_all_reduces(shard, comm)
    return shard.eval()

