"""A lean single-token decode step for the draft model, straight over its weights.

A 1.2M-parameter draft does almost no arithmetic per token: on a CPU its step through layer
3's serving forward (~1.3 ms on one thread) is nearly all per-op dispatch and bookkeeping
(an AttentionContext built per step, padded attention with a mask and a GQA repeat,
a separate cache write). A draft proposes k tokens a round, so that overhead is paid k
times for each target pass. `LeanDecodeStep` runs the same network, one token per row, in
~25 tensor ops a layer: F.rms_norm, one merged qkv linear, RoPE on q and k together, the
new k, v copied into the draft's ContiguousKVCache, SDPA with the GQA groups folded into
the query length (no repeat, no mask at one row), o_proj, the merged gate/up, SiLU * up, down
(the big ones optionally from fp16 copies: `half`).

It computes what the serving forward computes, up to float rounding (the order of a few
adds and the RoPE formula), and writes the same cache slots, so the two can take turns on
one cache (the forward feeds prompts and catch-up chunks). Only the draft runs it: the
target verifies every guess, so rounding changes a guess at most, never the output.
Configs it does not cover (Qwen3's q/k norms, sliding windows): `unsupported` says why.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from layer3_model import ContiguousKVCache, LlamaModel, capture_graph


class LeanDecodeStep:
    """step(ids (B,), rows, positions) -> fp32 logits (B, V): token b at position
    positions[b] of cache row rows[b]; its k, v land in that slot of `cache`.

    half: fp16 copies of an fp32 model's three largest projections (gate_up, down and the
    lm_head, 80 % of the course draft's bytes), used by the step (activations cast around
    them). On a CPU each target pass (44 MB for the course target) evicts the draft from
    the caches, so a draft step streams its weights from memory: half the bytes cut it from
    ~1.0 to ~0.7 ms in the speculation loop (same guesses on the course pair's prompts).
    The q/k/v and o projections stay fp32: at 160 x 224 fp16 is no faster there."""

    def __init__(self, net: LlamaModel, cache: ContiguousKVCache, *,
                 half: bool = False) -> None:
        why = self.unsupported(net)
        if why:
            raise ValueError(f"LeanDecodeStep does not cover this model: {why}")
        c = net.config
        self.net, self.cache = net, cache
        self.hq, self.hkv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.eps, self.hidden = c.rms_norm_eps, c.hidden_size
        self.scale = 1.0 / c.head_dim ** 0.5
        def big(w: torch.Tensor | None) -> torch.Tensor | None:
            return w.detach().half() if half and w is not None and w.dtype == torch.float32 \
                else w
        self.layers = [(lay.attn_norm.weight, lay.attn.qkv.weight, lay.attn.qkv.bias,
                        lay.attn.o_proj.weight, lay.attn.o_proj.bias, lay.mlp_norm.weight,
                        big(lay.mlp.gate_up.weight), big(lay.mlp.gate_up.bias),
                        big(lay.mlp.down.weight), big(lay.mlp.down.bias)) for lay in net.layers]
        self.lm_head = big(net.lm_head.weight)
        # rotate_half(x) * sin == roll(x, D/2) * [-sin | sin]: RoPE in three ops on q and k
        # together; tables (positions, D) in the model's dtype.
        self.cos = torch.cat([net.cos, net.cos], -1).to(net.dtype)
        self.sin = torch.cat([-net.sin, net.sin], -1).to(net.dtype)
        self.k_slots = [cache.k[i].view(-1, self.hkv, self.d) for i in range(len(self.layers))]
        self.v_slots = [cache.v[i].view(-1, self.hkv, self.d) for i in range(len(self.layers))]

    @staticmethod
    def unsupported(net: LlamaModel) -> str | None:
        """Why the lean step cannot run this network, or None."""
        c = net.config
        if c.qk_norm:
            return "per-head q/k RMSNorm (Qwen3)"
        if any(w is not None for w in c.layer_windows):
            return "sliding-window layers"
        if c.num_attention_heads % c.num_key_value_heads:
            return "query heads not a multiple of kv heads"
        return None

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, rows: Sequence[int],
             positions: Sequence[int]) -> torch.Tensor:
        B, cache = len(rows), self.cache
        n = max(positions) + 1
        if n > cache.max_len:
            raise ValueError(f"position {n - 1} past the draft cache's {cache.max_len} slots")
        dev = ids.device
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        slots = torch.tensor(rows, dtype=torch.int64, device=dev) * cache.max_len + pos
        identity = list(rows) == list(range(B))
        row_idx = None if identity else torch.tensor(rows, dtype=torch.int64, device=dev)
        mask = None
        if B > 1 and min(positions) + 1 < n:  # rows of unequal length: hide later slots
            mask = (torch.arange(n, device=dev)[None, :] <= pos[:, None])[:, None, None, :]
        return self.forward(ids, pos, slots, n, mask, row_idx)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, n: int,
                mask: torch.Tensor | None, row_idx: torch.Tensor | None) -> torch.Tensor:
        """The step on device tensors: attention over the first n slots of cache rows row_idx
        (None: rows 0..B-1), mask (B, 1, 1, n) bool or None. No host reads: capturable."""
        B, cache, net = ids.shape[0], self.cache, self.net
        hq, hkv, d, dt = self.hq, self.hkv, self.d, net.dtype
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (B, 1, D)
        x = F.embedding(ids, net.embed.weight)  # (B, H)
        residual = None
        for i, (an, wqkv, bqkv, wo, bo, mn, wgu, bgu, wd, bd) in enumerate(self.layers):
            residual = x if residual is None else residual + x
            h = F.rms_norm(residual, (self.hidden,), an, self.eps)
            qkv = F.linear(h, wqkv, bqkv)
            qk = qkv[:, : (hq + hkv) * d].view(B, hq + hkv, d)
            qk = qk * cos + qk.roll(d // 2, -1) * sin
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, (hq + hkv) * d:].view(B, hkv, d)
            self.k_slots[i].index_copy_(0, slots, k)
            self.v_slots[i].index_copy_(0, slots, v)
            if row_idx is None:
                keys, values = cache.k[i, :B, :n], cache.v[i, :B, :n]
            else:
                keys, values = cache.k[i, row_idx, :n], cache.v[i, row_idx, :n]
            # GQA: each kv head's g query heads become g "query positions" of that head, all
            # of which see every cached key (one new token per row: nothing to hide causally)
            o = F.scaled_dot_product_attention(
                q.reshape(B, hkv, hq // hkv, d), keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=mask, scale=self.scale)
            x = F.linear(o.reshape(B, hq * d), wo, bo)
            residual = residual + x
            h = F.rms_norm(residual, (self.hidden,), mn, self.eps)
            gate, up = F.linear(h.to(wgu.dtype), wgu, bgu).to(dt).chunk(2, -1)
            x = F.linear((F.silu(gate) * up).to(wd.dtype), wd, bd).to(dt)
        h = F.rms_norm(residual + x, (self.hidden,), net.norm.weight, self.eps)
        return F.linear(h.to(self.lm_head.dtype), self.lm_head).float()


class LeanGraphStep:
    """LeanDecodeStep for cache rows 0..B-1 replayed from a CUDA graph: static input
    buffers, attention over every slot of the rows masked by position (shapes that do not
    change with the sequence). ~55 kernels a step for the course draft where a captured
    serving forward (layer 3's CudaGraphDecoder) replays ~150: on a GPU the small draft is
    launch- and latency-bound, so fewer, fused kernels are the whole cost.
    step(ids (B,), positions (B,) device tensor) -> fp32 logits (B, V) (a copy)."""

    def __init__(self, lean: LeanDecodeStep, batch: int, *, warmup: int = 2) -> None:
        cache, dev = lean.cache, lean.net.device
        if dev.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device; the draft is on {dev}")
        if not 1 <= batch <= cache.batch:
            raise ValueError(f"batch {batch} must be in [1, {cache.batch}] (the cache's rows)")
        self.lean, self.batch = lean, batch
        self.ids = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.pos = torch.full((batch,), cache.max_len - 1, dtype=torch.int64, device=dev)
        self._row_base = torch.arange(batch, device=dev) * cache.max_len
        self._slots = torch.arange(cache.max_len, device=dev)
        self.graph, self.logits = capture_graph(self._run, warmup, mode=torch.inference_mode)

    def _run(self) -> torch.Tensor:
        mask = (self._slots[None, :] <= self.pos[:, None])[:, None, None, :]
        return self.lean.forward(self.ids, self.pos, self._row_base + self.pos,
                                 self.lean.cache.max_len, mask, None)

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.pos.copy_(positions)
        self.graph.replay()
        return self.logits.clone()
