"""A scheduled step -> flat tensors + AttentionContext -> the model -> logits -> tokens.

The model (layer 3's LlamaModel, unchanged) takes a flat list of T new tokens from B
sequences and an AttentionContext; the paged cache turns block tables into slot_mapping
and a (B, max_blocks) block_tables tensor. One forward pass serves a *mixed* step:
sequences prefilling a chunk and sequences decoding one token side by side, so the weights
are read once for all of them.

Layer 3's general attention path pads every sequence's queries to the step's longest
(B, max_query_len, ...) and its keys to the longest context, so its score tensor is
B * Hq * max_query_len * max_seq_len floats. A step with 256 decodes and one 1024-token chunk
would pad all 256 to 1024 queries. `plan_passes` keeps that bounded: a step whose padded
scores would exceed attn_bytes_limit runs as several passes (the decodes together, where
the paged decode kernel takes over, then the chunks in groups).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

import layer3_model as l3

from .cuda_graph_runner import CudaGraphRunner
from .paged_cache import PagedKVCache
from .scheduler import ScheduledSeq, SchedulerOutput

DEFAULT_ATTN_BYTES_LIMIT = 512 * 2**20


class ModelRunner:
    """Runs scheduled steps of `net` over `cache`. cuda_graph: replay decode-only passes from
    captured CUDA graphs (cuda_graph_runner.py; CUDA only) for up to max_num_seqs sequences."""

    def __init__(self, net: l3.LlamaModel, cache: PagedKVCache, *, attn_bytes_limit: int = DEFAULT_ATTN_BYTES_LIMIT,
                 cuda_graph: bool = False, max_num_seqs: int = 256, max_model_len: int = 2048) -> None:
        self.net, self.cache, self.attn_bytes_limit = net, cache, attn_bytes_limit
        self.device = net.device
        self.graph = None
        if cuda_graph and self.device.type == "cuda":  # on a CPU: eager decode (nothing to capture)
            self.graph = CudaGraphRunner(net, cache, max_num_seqs, -(-max_model_len // cache.block_size))

    # ---- planning ---------------------------------------------------------------------------
    def padded_attention_bytes(self, group: Sequence[ScheduledSeq]) -> int:
        """fp32 score bytes of layer 3's padded attention for these sequences in one pass."""
        if all(s.query_len == 1 for s in group):
            return 0  # a decode pass: the cache's decode_attention, no padded queries
        max_q = max(s.query_len for s in group)
        max_s = max(s.context_len + s.query_len for s in group)
        return len(group) * self.net.config.num_attention_heads * max_q * max_s * 4

    def plan_passes(self, scheduled: Sequence[ScheduledSeq]) -> list[list[int]]:
        """Indices of `scheduled` per forward pass: all in one (a mixed batch) unless that
        would pad too much; then the single-token queries together and the rest greedily."""
        everyone = list(range(len(scheduled)))
        if self.padded_attention_bytes(scheduled) <= self.attn_bytes_limit:
            return [everyone] if everyone else []
        singles = [i for i in everyone if scheduled[i].query_len == 1]
        passes, current = ([singles] if singles else []), []
        for i in everyone:
            if scheduled[i].query_len == 1:
                continue
            if current and self.padded_attention_bytes([scheduled[j] for j in current + [i]]) > self.attn_bytes_limit:
                passes.append(current)
                current = []
            current.append(i)
        return passes + ([current] if current else [])

    # ---- running ----------------------------------------------------------------------------
    @torch.no_grad()
    def execute(self, out: SchedulerOutput) -> list[torch.Tensor | None]:
        """Run the step. Returns, per scheduled sequence, fp32 logits (1 + len(spec_token_ids), V)
        for the positions whose next token is wanted (the last input token, and every draft
        token under speculation), or None when a prefill chunk does not reach the end."""
        self.cache.copy_blocks(out.copies)  # copy-on-write before anything is written
        results: list[torch.Tensor | None] = [None] * len(out.scheduled)
        for group in self.plan_passes(out.scheduled):
            for i, logits in zip(group, self._forward([out.scheduled[i] for i in group]), strict=True):
                results[i] = logits
        return results

    def _forward(self, group: list[ScheduledSeq]) -> list[torch.Tensor | None]:
        ids = torch.tensor([t for s in group for t in s.input_ids], dtype=torch.int64).to(self.device)
        ctx = self.cache.context([s.query_len for s in group], [s.context_len for s in group],
                                 [s.seq.block_table for s in group])
        speculating = any(s.spec_token_ids for s in group)
        if self.graph is not None and ctx.max_query_len == 1 and self.graph.can_run(len(group), ctx.block_tables.shape[1]):
            logits = self.graph.run(ids, ctx.positions, ctx.block_tables, ctx.seq_lens)  # (B, V)
        else:
            logits = self.net(ids, ctx, self.cache, last_only=not speculating)  # (B, V) or (T, V)
        rows, start = [], 0
        for b, s in enumerate(group):
            start += s.query_len
            if not s.samples:
                rows.append(None)
            elif speculating:  # rows of the last real token and of every draft token
                rows.append(logits[start - 1 - len(s.spec_token_ids):start])
            else:
                rows.append(logits[b:b + 1])
        return rows

    def sample(self, logits: Sequence[torch.Tensor], params: Sequence[l3.SamplingParams],
               generators: Sequence[torch.Generator | None]) -> list[int]:
        """One token per row of logits (each (V,)): greedy rows by one batched argmax, the rest
        by layer 3's sampler with each sequence's own generator. One host sync."""
        if not logits:
            return []
        x = torch.stack(list(logits))
        out = torch.empty(len(logits), dtype=torch.int64, device=x.device)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        other = [i for i, p in enumerate(params) if not p.greedy]
        if greedy:
            idx = torch.tensor(greedy, device=x.device)
            out[idx] = x[idx].argmax(dim=-1)
        if other:
            idx = torch.tensor(other, device=x.device)
            out[idx] = l3.sample(x[idx], [params[i] for i in other], [generators[i] for i in other])
        return out.tolist()
