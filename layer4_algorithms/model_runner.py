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
the paged decode kernel takes over, then the chunks in groups). The triton backend's flash
kernels pad nothing (layer 3's `pads_prefill_attention`): its mixed steps stay one pass.

No step copies to the host until its tokens are read: the step's index arrays go to the
device from reusable pinned buffers without waiting for the GPU (layer 3's HostStaging),
`sample_tokens` leaves the tokens on the device, and under async scheduling a decoding
sequence's input token is taken from the previous step's sampled-token tensor on the device
(`execute(out, prev_tokens)`), so the host can prepare step N+1 while the GPU runs step N.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

import layer3_model as l3

from .block_table_mirror import BlockTableMirror
from .config import EngineConfig
from .cuda_graph_runner import CudaGraphRunner
from .decode_inputs import decode_inputs
from .kv import PagedKVCache
from .prefill_graph_runner import PrefillGraphRunner
from .scheduler import ScheduledSeq, SchedulerOutput
from .step_logits import StepLogits
from .step_sampling import StepSampler


def prefill_graphs_wanted(switch: bool | None, net) -> bool:
    """Whether a runner of `net` captures prefill graphs (EngineConfig.prefill_cuda_graph):
    True on CUDA (an error there if they cannot work: PrefillGraphRunner says why); None where
    they work: a plain LlamaModel (not a subclass such as an MoE model, whose routing syncs
    with the host; not a parallel wrapper) whose attention is the flash path; never off CUDA."""
    if net.device.type != "cuda" or switch is False:
        return False
    return switch or (type(net) is l3.LlamaModel and not l3.pads_prefill_attention(net))


class ModelRunner(StepSampler):
    """Runs scheduled steps of `net` (LlamaModel, or anything with its forward signature and
    `.config`, `.device`) over `cache`, with config.attn_bytes_limit per pass. config.cuda_graph:
    replay decode-only passes from captured CUDA graphs (cuda_graph_runner.py; CUDA only) for
    up to config.max_num_seqs sequences of config.max_model_len tokens; config.prefill_cuda_graph
    (prefill_graphs_wanted): other passes of a few sequences from graphs per token bucket
    (prefill_graph_runner.py), eager where none fits. Its logits become
    tokens through StepSampler's `sample` / `sample_tokens` (step_sampling.py)."""

    def __init__(self, net: l3.LlamaModel, cache: PagedKVCache, config: EngineConfig) -> None:
        self.net = net
        self.cache = cache
        self.config = config
        self.attn_bytes_limit = config.attn_bytes_limit
        self.device = net.device
        self.staging = l3.HostStaging(self.device)  # pinned, double-buffered: one arena per step
        max_blocks = -(-config.resolved_max_model_len // cache.block_size)
        self.tables = BlockTableMirror(config.max_num_seqs, max_blocks + 1)
        self.graph = None
        self.last_bad: torch.Tensor | None = None  # the last sample_tokens call's void rows
        if config.cuda_graph and self.device.type == "cuda":  # on a CPU: eager, nothing to capture
            self.graph = CudaGraphRunner(net, cache, config.max_num_seqs, max_blocks)
        self.prefill_graph = None
        if prefill_graphs_wanted(config.prefill_cuda_graph, net):
            self.prefill_graph = PrefillGraphRunner(net, cache, config.max_num_batched_tokens,
                                                    max_blocks + 1)

    # ---- planning ---------------------------------------------------------------------------
    def padded_attention_bytes(self, group: Sequence[ScheduledSeq]) -> int:
        """fp32 score bytes of layer 3's padded attention for these sequences in one pass."""
        if not l3.pads_prefill_attention(self.net):
            return 0  # flash kernels at each sequence's length (triton backend): no padding
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
            grown = [scheduled[j] for j in current + [i]]
            if current and self.padded_attention_bytes(grown) > self.attn_bytes_limit:
                passes.append(current)
                current = []
            current.append(i)
        return passes + ([current] if current else [])

    # ---- running ----------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput, prev_tokens: torch.Tensor | None = None) -> StepLogits:
        """Run the step. Returns its logits: one fp32 row per sampling sequence (the last input
        token's) in one tensor, and for speculating sequences their (1 + len(spec_token_ids), V)
        rows; indexing the result by scheduled position gives a sequence's rows (None for a
        prefill chunk that does not reach the end). prev_tokens: the previous step's sampled
        tokens on the device, where a ScheduledSeq with `pending` >= 0 finds its input token.
        The returned logits may view a CUDA graph's output buffer: sample them before the next
        execute (the engine does). (Autograd is off around every forward run here; a graph
        replay and the copies around it need no switch.)"""
        self.staging.next_step()
        self.cache.copy_blocks(out.copies)  # copy-on-write before anything is written
        scheduled = out.scheduled
        if len(scheduled) == 1 and self.prefill_graph is not None:
            lone = self._lone_prefill(scheduled[0], prev_tokens)
            if lone is not None:
                return lone
        # a decode step: one pass over it (plain decodes only: its shape and tables known)
        fast = decode_inputs(self.tables, scheduled, out.plain_decodes == len(scheduled))
        if fast is None:
            with torch.no_grad():
                return self._execute(scheduled, prev_tokens)
        if self.graph is not None:
            last = self._graph_run(*self._graph_ids(fast, prev_tokens), fast.table, fast.lens,
                                   fast.context_lens)
            if last is not None:
                # the graph's greedy tokens come with its logits (an all-greedy step samples
                # nothing); a view of its buffer, which the next step overwrites: on a GPU their
                # copy to the host is queued before that, a CPU's launched step keeps the tensor
                tokens = self.graph.tokens(last.shape[0])
                return StepLogits(last, fast.rows, {}, self.staging,
                                  argmax=tokens if tokens.is_cuda else tokens.clone())
        ids = self.place_ids(fast.ids, fast.src, fast.dst, prev_tokens, fast.in_order)
        with torch.no_grad():
            ctx = self.cache.context(np.ones(len(fast.rows), dtype=np.int64),
                                     fast.context_lens, fast.table,
                                     staging=self.staging, table=(fast.table, fast.lens))
            last, _ = self._run(scheduled, ids, ctx)
        return StepLogits(last, fast.rows, {}, self.staging)

    def _lone_prefill(self, s: ScheduledSeq, prev_tokens: torch.Tensor | None
                      ) -> StepLogits | None:
        """A step of one sequence's prompt (chunk) from the prefill graphs without the general
        path's passes (what _execute would do for it: one pass, the same graph), or None (not
        such a step, or no graph fits: the general path then)."""
        if s.num_new_tokens < 2 or s.spec_token_ids:
            return None
        last = self._graph_prefill([s], None, prev_tokens)
        if last is None:
            return None
        row = 0 if s.context_len + s.num_new_tokens == s.seq.num_tokens else None  # s.samples
        return StepLogits(last, [row], {}, self.staging)

    def _execute(self, scheduled: Sequence[ScheduledSeq],
                 prev_tokens: torch.Tensor | None) -> StepLogits:
        """execute() of a step that is not all one-token decodes: its passes (plan_passes)."""
        rows: list[int | None] = [None] * len(scheduled)
        spec: dict[int, torch.Tensor] = {}
        parts, offset = [], 0
        decode = all(s.num_new_tokens == 1 and not s.spec_token_ids for s in scheduled)
        for group in [list(range(len(scheduled)))] if decode else self.plan_passes(scheduled):
            members = scheduled if decode else [scheduled[i] for i in group]
            last, spec_rows = self._forward(members, prev_tokens)
            for j, i in enumerate(group):
                s = scheduled[i]
                if s.context_len + s.num_new_tokens == s.seq.num_tokens:  # s.samples
                    rows[i] = offset + j
            for j, r in spec_rows.items():
                spec[group[j]] = r
            parts.append(last)
            offset += last.shape[0]
        if not parts:
            return StepLogits(torch.empty(0, 0), rows, spec)
        return StepLogits(parts[0] if len(parts) == 1 else torch.cat(parts), rows, spec,
                          self.staging)

    def input_ids(self, group: list[ScheduledSeq],
                  prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """The pass's input ids (T,) on the device: host ids in one pinned copy; a sequence's
        token still on the device (`pending`) gathered from prev_tokens there."""
        if not any(s.pending >= 0 for s in group):
            return self.staging.to_device(self.host_ids(group))
        ids, src, dst = [], [], []
        for s in group:
            if s.pending >= 0:  # one input token: the previous step's sample, not on the host
                dst.append(len(ids))
                src.append(s.pending)
                ids.append(0)
            elif s.num_new_tokens == 1 and not s.spec_token_ids:
                ids.append(s.seq.token_ids[s.context_len])
            else:
                ids += s.input_ids
        return self.place_ids(ids, src, dst, prev_tokens)

    @staticmethod
    def host_ids(group: list[ScheduledSeq], copy: bool = True) -> np.ndarray:
        """The pass's input ids (T,) int64 on the host (a new array; copy=False: a lone
        prompt's may view its prompt_array, read only), none of them `pending`: a prompt's
        chunk sliced from its sequence's prompt_array (no per-token conversion: 2k tokens of a
        list to numpy cost ~40 us), other tokens from the lists."""
        parts = []
        for s in group:
            arr, c, n = s.seq.prompt_array, s.context_len, s.num_new_tokens
            if arr is not None and c + n <= arr.shape[0] and not s.spec_token_ids:
                parts.append(arr[c:c + n])
            elif n == 1 and not s.spec_token_ids:
                parts.append(np.array([s.seq.token_ids[c]], dtype=np.int64))
            else:
                parts.append(np.array(s.input_ids, dtype=np.int64))
        if len(parts) == 1:
            return parts[0].copy() if copy else parts[0]
        return np.concatenate(parts)

    def place_ids(self, ids: list[int], src: list[int], dst: list[int],
                  prev_tokens: torch.Tensor | None, in_order: bool = False) -> torch.Tensor:
        """Input ids (T,) on the device from host ids where ids[dst[i]] is a placeholder for
        prev_tokens[src[i]] (a token still on the device). in_order: src is 0..T-1 and dst
        every position (the same sequences decoding in the same order as last step): the ids
        are prev_tokens[:T], a view (no index copy to the device, no gather kernel)."""
        if in_order and prev_tokens is not None and prev_tokens.shape[0] >= len(ids):
            return prev_tokens if prev_tokens.shape[0] == len(ids) else prev_tokens[:len(ids)]
        if not dst:
            return self.staging.to_device(np.array(ids, dtype=np.int64))
        if prev_tokens is None:
            raise RuntimeError("a scheduled sequence's input token is on the device, but the "
                               "previous step's tokens were not given (execute(out, prev_tokens))")
        T = len(ids)
        if len(dst) == T:  # a decode step of sequences that all decoded last step
            return prev_tokens[self.staging.to_device(np.array(src, dtype=np.int64))]
        packed = self.staging.to_device(np.array(ids + src + dst, dtype=np.int64))
        out, src_t, dst_t = packed[:T], packed[T:T + len(src)], packed[T + len(src):]
        out[dst_t] = prev_tokens[src_t]
        return out

    def _graph_ids(self, fast, prev_tokens: torch.Tensor | None
                   ) -> tuple[torch.Tensor | np.ndarray, np.ndarray | None]:
        """A decode step's input ids as the graph runner takes them (run_host): on the host
        (numpy: they go with the context, one copy), all on the device in another order than
        the last step's (its tokens, and the gather index that goes with the context), or
        placed on the device (place_ids: the last step's tokens in order, or a mix)."""
        if not fast.dst:
            return np.array(fast.ids, dtype=np.int64), None
        if prev_tokens is not None and not fast.in_order and len(fast.dst) == len(fast.ids):
            return prev_tokens, np.array(fast.src, dtype=np.int64)
        return self.place_ids(fast.ids, fast.src, fast.dst, prev_tokens, fast.in_order), None

    def _forward(self, group: list[ScheduledSeq], prev_tokens: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """One pass: (B, V) fp32 logits of each sequence's last input token, and for the
        speculating ones (index in group -> (1 + k, V)) the rows of the last real token and
        drafts."""
        ids = None
        if self.graph is not None and all(s.query_len == 1 for s in group):
            ids = self.input_ids(group, prev_tokens)
            logits = self._graph_decode(group, ids)
            if logits is not None:  # (B, V), a view of the graph's output: sampled first
                return logits, {}
        if self.prefill_graph is not None:
            logits = self._graph_prefill(group, ids, prev_tokens)
            if logits is not None:  # (k, V), a view of the graph's output: sampled first
                return logits, {}
        if ids is None:
            ids = self.input_ids(group, prev_tokens)
        qlens = [s.num_new_tokens + len(s.spec_token_ids) for s in group]
        seqs = [s.seq for s in group]
        ctx = self.cache.context(qlens, [s.context_len for s in group],
                                 [q.block_table for q in seqs], staging=self.staging,
                                 table=self.tables.gather(seqs))
        return self._run(group, ids, ctx)

    def _run(self, group: list[ScheduledSeq], ids: torch.Tensor, ctx: l3.AttentionContext
             ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The pass's forward (from a CUDA graph when one fits), its inputs built."""
        speculating = ctx.num_tokens > len(group) and any(s.spec_token_ids for s in group)
        graphable = ctx.max_query_len == 1 and self.graph is not None
        if graphable and self.graph.can_run(len(group), ctx.block_tables.shape[1]):
            # (B, V), a view of the graph's output: sampled before the next replay
            return self.graph.run(ids, ctx.positions, ctx.block_tables, ctx.seq_lens,
                                  copy=False), {}
        logits = self.net(ids, ctx, self.cache, last_only=not speculating)  # (B, V) or (T, V)
        if not speculating:
            return logits, {}
        ends = ctx.query_start_loc[1:] - 1  # each sequence's last input token
        spec, start = {}, 0
        for b, s in enumerate(group):
            start += s.query_len
            if s.spec_token_ids:
                spec[b] = logits[start - 1 - len(s.spec_token_ids):start]
        return logits[ends], spec

    def _graph_prefill(self, group: list[ScheduledSeq], ids: torch.Tensor | None,
                       prev_tokens: torch.Tensor | None) -> torch.Tensor | None:
        """A pass replayed from the prefill graphs (prefill_graph_runner.py), or None when
        none fits it (then it runs eagerly). ids: the pass's ids on the device if made already,
        else the host's go with the graph's other inputs (one copy) unless one is `pending`."""
        plan = self.prefill_graph.plan(group)
        if plan is None:
            return None
        if plan[1] == "one":  # a fresh prompt's table from its list, its mirror row left as
            got = self.tables.row_of(group[0].seq)  # it is (a later step that needs it syncs)
        else:
            got = self.tables.gather([s.seq for s in group])
        if got is None:
            return None
        if ids is None:
            ids = (self.input_ids(group, prev_tokens) if any([s.pending >= 0 for s in group])
                   else self.host_ids(group, copy=False))  # (run copies them, pinned)
        return self.prefill_graph.run(plan, group, ids, *got)

    def _graph_decode(self, group: list[ScheduledSeq], ids: torch.Tensor) -> torch.Tensor | None:
        """A decode pass replayed from the CUDA graphs, its inputs without a whole
        AttentionContext: the graph takes positions, seq_lens and block tables (it works out
        the slots itself), so one pinned copy of those three is all the host prepares.
        None: the graphs do not fit this pass (or a table is short: the general path says
        so), which then runs as any other."""
        got = self.tables.gather([s.seq for s in group])
        if got is None:
            return None
        table, lens = got
        pos = np.fromiter((s.context_len for s in group), dtype=np.int64, count=len(group))
        return self._graph_run(ids, None, table, lens, pos)

    def _graph_run(self, ids: torch.Tensor | np.ndarray, gather: np.ndarray | None,
                   table: np.ndarray, lens: np.ndarray, pos: np.ndarray) -> torch.Tensor | None:
        """_graph_decode from the pass's ids (as _graph_ids gives them), (B, n) block table,
        table lengths and positions."""
        B, n = table.shape
        if not self.graph.can_run(B, n):
            return None
        if (lens * self.cache.block_size <= pos).any():
            return None
        return self.graph.run_host(ids, pos, table, gather)  # (seq_lens = pos + 1: one copy)
