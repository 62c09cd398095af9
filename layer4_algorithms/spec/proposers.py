"""Proposers: cheap guesses of the next k tokens, for the target to verify in one pass.

* `NgramProposer` (prompt lookup): find the latest earlier occurrence of the sequence's last
  n tokens (n from max_n down to min_n) and propose the k tokens that followed it. No model,
  no state; it shines when the output copies its input (quoting, editing, repeating).
* `DraftModelProposer`: a small model of the same tokenizer runs k autoregressive steps
  with its own KV cache (a ContiguousKVCache, one row per sequence slot).

Both return a `Proposal`. Deterministic proposals carry no probabilities (q is one-hot);
a draft that samples carries q (B, K, V) for the rejection test.

The draft's cache rolls back by itself: it remembers which tokens each row holds, and at
the next call keeps only the longest prefix still equal to the sequence (rejected guesses
drop out), then feeds the tokens it has not seen (1 after a rejection, 2 after a full
accept: the last guess and the bonus token; the whole prompt on the first call).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from layer3_model import ContiguousKVCache, CudaGraphDecoder, LlamaModel, SamplingParams

from .draft_step import LeanDecodeStep, LeanGraphStep
from .proposal import Proposal
from .sampling import Generators, draw_uniforms, processed_probs, sample_from_probs


def _padded(rows: list[list[int]], K: int,
            device: torch.device | str | None = None) -> torch.Tensor:
    """Ragged token lists -> (B, K) int64, zero-padded on the right."""
    return torch.tensor([r + [0] * (K - len(r)) for r in rows], dtype=torch.int64,
                        device=device).view(len(rows), K)


class Proposer(Protocol):
    """What the speculative loop (or an engine) calls. rows: a stable slot id per sequence
    (the draft's cache row); token_ids: each sequence's prompt + output so far; k: how many
    tokens to propose for each (0 allowed)."""

    def propose(self, token_ids: Sequence[Sequence[int]], rows: Sequence[int], k: Sequence[int],
                params: Sequence[SamplingParams], generators: Generators) -> Proposal: ...

    def release(self, row: int) -> None:
        """The sequence in this row finished: forget its state."""
        ...


class NgramProposer:
    """Prompt-lookup speculation: match the last n tokens (max_n down to min_n) against the
    earlier sequence; propose what followed the latest match (up to k tokens)."""

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """The continuation of the latest earlier match of the longest matching suffix."""
        L = len(tokens)
        if k <= 0 or L < self.min_n + 1:
            return []
        t = torch.as_tensor(tokens, dtype=torch.int64)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            # windows starting at 0..L-n-1: every earlier n-gram that has a successor
            windows = t[: L - 1].unfold(0, n, 1)
            hits = (windows == t[L - n:]).all(dim=1).nonzero()
            if len(hits):
                start = int(hits[-1]) + n
                return t[start: start + k].tolist()
        return []

    def propose(self, token_ids, rows, k, params, generators) -> Proposal:
        guesses = [self.lookup(ids, kb) for ids, kb in zip(token_ids, k, strict=True)]
        K = max((len(g) for g in guesses), default=0)
        return Proposal(_padded(guesses, K),
                        torch.tensor([len(g) for g in guesses], dtype=torch.int64), None)

    def release(self, row: int) -> None:
        pass


class DraftModelProposer:
    """k autoregressive steps of a small draft model over the batch, its KV cache in a
    ContiguousKVCache of max_seqs rows x max_len slots. Greedy rows propose the draft's
    argmax (one-hot q); sampled rows draw from the processed draft distribution q.

    stop_below (dynamic draft length): a row stops proposing once the draft gave its latest
    guess less than this probability (softmax of the raw logits), so unsure guesses, likely
    rejected, cost no further draft steps. The rule looks only at the draft, never at the
    target, so the rejection sampling stays exact. None: always propose k.

    Single-token steps: a round's steps after its first, and its first where every row
    catches up on the same number m <= LEAN_CHUNK of tokens (1 after a rejection, 2 after a
    full accept; fed one at a time) skip the serving forward:
    * cuda_graph (on a CUDA device; SpeculativeDecoder turns it on there): replayed from a
      CUDA graph when the live rows are cache rows 0..n-1 (the small draft is launch-bound
      on a GPU): the lean step's (LeanGraphStep, ~55 kernels) or, where it does not cover
      the draft or lean=False, the serving forward's (layer 3's CudaGraphDecoder, ~150);
    * lean (elsewhere): LeanDecodeStep (draft_step.py), the same network in ~25 ops a layer,
      a third of the serving forward's CPU time at one row; on a CPU its big projections
      read fp16 copies (half the bytes: the target's pass evicts the draft from the caches).
    Both change what the draft guesses by rounding at most, never the output: the target
    verifies every guess. A longer catch-up (the prompt) is one serving forward."""

    LEAN_CHUNK = 4  # a longer catch-up (the prompt) is one serving forward: cheaper than steps

    def __init__(self, net: LlamaModel, max_seqs: int, max_len: int, *,
                 stop_below: float | None = None, cuda_graph: bool = False,
                 lean: bool = True) -> None:
        if stop_below is not None and not 0.0 <= stop_below < 1.0:
            raise ValueError(f"stop_below must be in [0, 1) or None, got {stop_below!r}")
        self.net, self.stop_below = net, stop_below
        self.cache = ContiguousKVCache.for_model(net.config, max_seqs, max_len, dtype=net.dtype,
                                                 device=net.device)
        # tokens whose k, v each row holds
        self.cached: list[list[int]] = [[] for _ in range(max_seqs)]
        self.max_len = max_len
        self.steps = 0  # draft forward passes run (for cost accounting)
        self.graph_steps = 0  # of which replayed from a CUDA graph
        self.lean_steps = 0  # of which LeanDecodeStep's
        self._lean = LeanDecodeStep(net, self.cache, half=net.device.type == "cpu") if lean and \
            LeanDecodeStep.unsupported(net) is None else None
        self.cuda_graph = cuda_graph and net.device.type == "cuda"
        self._graphs: dict[int, CudaGraphDecoder | LeanGraphStep] = {}
        self.graph_error: str | None = None
        if self.cuda_graph:  # captured now, outside any timed decode loop (more rows: lazily)
            try:
                self._graphs[max_seqs] = self._capture(max_seqs)
            except RuntimeError as err:  # not capturable here: eager steps, and say why
                self.cuda_graph, self.graph_error = False, f"{type(err).__name__}: {err}"

    def _capture(self, n: int) -> CudaGraphDecoder | LeanGraphStep:
        """The CUDA graph of an n-row single-token step: the lean step's where it covers the
        draft (a third of the kernels), else the serving forward's."""
        if self._lean is not None:
            try:
                return LeanGraphStep(self._lean, n)
            except RuntimeError as err:  # not capturable here: the serving forward's graph
                self.graph_error = f"lean graph: {type(err).__name__}: {err}"
        return CudaGraphDecoder(self.net, self.cache, n)

    def _token_steps(self, cache_rows: list[int], chunks: list[list[int]],
                     context: list[int]) -> torch.Tensor | None:
        """(n, V) logits after feeding row i its chunk through single-token steps, all
        chunks of one length m <= LEAN_CHUNK: replayed from the CUDA graph of n rows where
        one runs (cache rows 0..n-1), else LeanDecodeStep; None: run the serving forward."""
        n, m = len(cache_rows), len(chunks[0])
        if m > self.LEAN_CHUNK or any(len(x) != m for x in chunks):
            return None
        graph = self.cuda_graph and cache_rows == list(range(n))
        if not graph and self._lean is None:
            return None
        if graph and n not in self._graphs:
            self._graphs[n] = self._capture(n)
        dev = self.net.device
        for i in range(m):
            ids = torch.tensor([x[i] for x in chunks], dtype=torch.int64, device=dev)
            positions = [c + i for c in context]
            if graph:
                pos = torch.tensor(positions, dtype=torch.int64, device=dev)
                logits = self._graphs[n].step(ids, pos)
            else:
                logits = self._lean.step(ids, cache_rows, positions)
        if graph:
            self.graph_steps += m
        else:
            self.lean_steps += m
        self.steps += m - 1  # the caller counts one
        return logits

    def rollback(self, row: int, length: int) -> None:
        """Keep only the first `length` cached tokens of a row (later slots get overwritten)."""
        del self.cached[row][length:]

    def release(self, row: int) -> None:
        self.cached[row] = []

    def _catch_up(self, tokens: Sequence[int], row: int) -> list[int]:
        """Roll the row back to its longest prefix still equal to tokens; return what to feed."""
        held = self.cached[row]
        n = min(len(held), len(tokens) - 1)  # always feed >= 1 token: its logits propose
        if held[:n] != list(tokens[:n]):
            n = next(i for i, (a, b) in enumerate(zip(held, tokens, strict=False)) if a != b)
        self.rollback(row, n)
        return list(tokens[n:])

    @torch.inference_mode()
    def propose(self, token_ids, rows, k, params, generators) -> Proposal:
        B, K, dev = len(token_ids), max(k, default=0), self.net.device
        k = list(k)  # rows may stop early (stop_below): k[b] shrinks to what was proposed
        guesses: list[list[int]] = [[] for _ in range(B)]
        greedy = all(sp.greedy for sp in params)
        probs = None if greedy else torch.zeros(B, K, self.net.config.vocab_size, device=dev)
        live = [b for b in range(B) if k[b] > 0]
        feed = {b: self._catch_up(token_ids[b], rows[b]) for b in live}
        for j in range(K):
            live = [b for b in live if k[b] > j]
            if not live:
                break
            chunks = [feed[b] if j == 0 else guesses[b][-1:] for b in live]
            context = [len(self.cached[rows[b]]) for b in live]
            if max(c + len(x) for c, x in zip(context, chunks, strict=True)) > self.max_len:
                raise ValueError(f"draft cache rows hold {self.max_len} tokens: sequence too long")
            ids = torch.tensor([t for x in chunks for t in x], device=dev)
            logits = self._token_steps([rows[b] for b in live], chunks, context)
            if logits is None:
                ctx = self.cache.context([len(x) for x in chunks], context,
                                         rows=[rows[b] for b in live])
                logits = self.net(ids, ctx, self.cache, last_only=True)  # (len(live), V)
            self.steps += 1
            for b, x in zip(live, chunks, strict=True):
                self.cached[rows[b]].extend(x)
            if greedy:
                picked = logits.argmax(-1)
            else:
                q = processed_probs(logits, [params[b] for b in live])
                gens = generators if generators is None or isinstance(generators, torch.Generator) \
                    else [generators[b] for b in live]
                picked = sample_from_probs(q, draw_uniforms(gens, len(live), 1, dev)[:, 0])
                probs[live, j] = q
            for b, t in zip(live, picked.tolist(), strict=True):
                guesses[b].append(t)
            if self.stop_below is not None:
                sure = torch.softmax(logits.float(), -1).gather(-1, picked[:, None])[:, 0].tolist()
                for b, conf in zip(live, sure, strict=True):
                    if conf < self.stop_below:
                        k[b] = j + 1
        # the last guess of each row is not fed: the target verifies it, and the next call
        # feeds it (if accepted) together with the token that follows.
        K = max(k, default=0)
        probs = None if probs is None else probs[:, :K]
        return Proposal(_padded(guesses, K, dev), torch.tensor(k, dtype=torch.int64, device=dev),
                        probs)


class NgramThenDraftProposer:
    """Prompt lookup first, the draft model where it finds nothing: a row whose last
    `min_n`+ tokens occurred earlier proposes what followed them (free: no draft step); the
    other rows run the draft's k steps. On a CPU a draft step costs ~a fifth of a target
    step (the course pair, one thread: dispatch-bound), so every round the lookup answers
    saves k of them. The draft's cache needs no bookkeeping for skipped rounds: its next
    call catches up on the tokens it has not seen (DraftModelProposer._catch_up).
    Sampled rows get one-hot q for looked-up guesses (a deterministic proposal), so the
    rejection test stays exact."""

    def __init__(self, draft: DraftModelProposer, ngram: NgramProposer | None = None) -> None:
        self.draft, self.ngram = draft, ngram or NgramProposer(2, 4)
        self.lookups = 0  # rows answered by the lookup (for cost accounting)

    @property
    def steps(self) -> int:
        return self.draft.steps

    def propose(self, token_ids, rows, k, params, generators) -> Proposal:
        B, k = len(token_ids), list(k)
        looked = [self.ngram.lookup(ids, kb) for ids, kb in zip(token_ids, k, strict=True)]
        rest = [b for b in range(B) if not looked[b] and k[b] > 0]
        self.lookups += B - len(rest)
        sub = None
        if rest:
            sub_gens = generators if generators is None or isinstance(
                generators, torch.Generator) else [generators[b] for b in rest]
            sub = self.draft.propose([token_ids[b] for b in rest], [rows[b] for b in rest],
                                     [k[b] for b in rest], [params[b] for b in rest], sub_gens)
        guesses = [list(g) for g in looked]
        if sub is not None:
            for i, b in enumerate(rest):
                guesses[b] = sub.tokens[i, :int(sub.num_tokens[i])].tolist()
        K = max((len(g) for g in guesses), default=0)
        dev = self.draft.net.device
        probs = None
        if sub is not None and sub.probs is not None:  # sampled rows: q for every row
            probs = torch.zeros(B, K, sub.probs.shape[-1], device=dev)
            for b in range(B):
                if b in rest:
                    i = rest.index(b)
                    n = int(sub.num_tokens[i])
                    probs[b, :n] = sub.probs[i, :n]
                else:
                    n = len(guesses[b])
                    probs[b, torch.arange(n, device=dev),
                          torch.tensor(guesses[b], dtype=torch.long, device=dev)] = 1.0
        return Proposal(_padded(guesses, K, dev),
                        torch.tensor([len(g) for g in guesses], dtype=torch.int64, device=dev),
                        probs)

    def release(self, row: int) -> None:
        self.draft.release(row)
