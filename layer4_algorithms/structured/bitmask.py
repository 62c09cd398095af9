"""The token mask: which of the V tokens a constrained row may sample, applied to a batch.

A mask is a bitmask, 32 tokens per int32 word: row (W,) with W = ceil(V / 32), token t
allowed when bit t % 32 of word t // 32 is set (llguidance's and xgrammar's layout; 4 KB for
a 32k vocabulary instead of 32k bools). Per step:

    host    each constrained row's parser writes its row of a (R, W) int32 bitmask
            (llguidance walks its token trie against the lexer; a few us per row at a 4k
            vocabulary, more at 128k), in pinned memory reused step after step
            (`TokenMasks`): one by one on the engine's thread, or on llguidance's pool of
            `fill_threads` threads, a lane each (mask_fill.py says why)
    copy    the (R, W) bitmask and the R row indices to the device in one non-blocking copy
            (R * (W + 1) * 4 bytes: 16 KB at R = 32, V = 128k)
    apply   one Triton kernel (mask_kernel.py) sets the refused logits of those R rows to
            -inf in place; on a CPU the torch path does it (`caps`: a byte lookup, then
            one minimum over the rows)

The engine fills a step's masks after its forward pass is launched, so the host's fill runs
while the GPU computes the logits; under async scheduling it first reads the previous step's
tokens (already on their way to the host, ahead of this forward on the stream), advances the
grammars with them, fills, then applies and samples: the mask of step t + 1 needs the token of
step t, and nothing more. Under CUDA-graph decoding the apply (copy + kernel) replays from a
CUDA graph of its own, which for an all-greedy step also writes the masked rows' argmax
(mask_graph.py).

Rows without a grammar are not touched, and the mask acts on the logits after the forward
pass (outside a CUDA graph: the graph's output buffer is masked before it is sampled), so
greedy, temperature, top-k / top-p and speculative verification all draw only from allowed
tokens: masking a logit to -inf is exactly renormalising the distribution over the rest.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import torch

from .mask_fill import POOL_MIN_ROWS, fill_masks
from .mask_graph import MaskGraphs, plain


def words(vocab_size: int) -> int:
    """int32 words per mask row: ceil(V / 32)."""
    return (vocab_size + 31) // 32


def allocate(rows: int, vocab_size: int, *, pin: bool = False) -> torch.Tensor:
    """(rows, W) int32, every token allowed (all bits set); pinned for a fast device copy."""
    return torch.full((rows, words(vocab_size)), -1, dtype=torch.int32,
                      pin_memory=pin and torch.cuda.is_available())


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, W) int32 -> (R, V) bool, True where the token is allowed."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1  # (R, W, 32)
    return allowed.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor,
                         rows: torch.Tensor | Sequence[int] | None = None, *,
                         impl: str = "auto") -> torch.Tensor:
    """logits (N, V) float; bitmask (R, W) int32 (any device); rows (R,): the logits row each
    bitmask row masks (None: R == N, row r masks row r). Refused tokens -> -inf, in place;
    returns logits. impl: "auto" (the Triton kernel on CUDA tensors, the torch reference
    elsewhere), "triton" (Triton's interpreter on a CPU), "torch"."""
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"need logits (N, V) and a bitmask (R, W); got {tuple(logits.shape)} "
                         f"and {tuple(bitmask.shape)}")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words covers "
                         f"{bitmask.shape[1] * 32} tokens, the logits have {logits.shape[1]}")
    if rows is None and logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"{bitmask.shape[0]} bitmask rows for {logits.shape[0]} logits rows: "
                         f"say which rows they mask (rows=)")
    if rows is not None and len(rows) != bitmask.shape[0]:
        raise ValueError(f"{len(rows)} row indices for {bitmask.shape[0]} bitmask rows")
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if rows is not None and not isinstance(rows, torch.Tensor):
        rows = torch.tensor(list(rows), dtype=torch.int64)
    if impl == "triton" or (impl == "auto" and logits.device.type == "cuda"):
        from .mask_kernel import apply_bitmask_triton

        if rows is None:
            rows = torch.arange(bitmask.shape[0], device=logits.device)
        return apply_bitmask_triton(logits, bitmask.contiguous(), rows.to(logits.device))
    cap = caps(bitmask, logits.shape[1], logits.dtype)
    if rows is None:
        return torch.minimum(logits, cap, out=logits)
    rows = rows.to(logits.device, torch.int64)
    return logits.index_copy_(0, rows, torch.minimum(logits.index_select(0, rows), cap))


_CAP_LUT: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def caps(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """(R, W) int32 -> (R, V) of dtype: +inf where the token is allowed, -inf where refused,
    so that minimum(logits, caps) is the masked logits. Made by one lookup per bitmask byte
    in a (256, 8) table (row b: bit i of b -> +inf / -inf) instead of unpacking through
    (R, W, 32) int32 temporaries: on a CPU, at (32, 4096), ~70 us with the minimum against
    ~400 us for unpack + masked_fill_ (whose CPU kernel is the slow part)."""
    key = (dtype, bitmask.device)
    lut = _CAP_LUT.get(key)
    if lut is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1  # (256, 8), little end
        lut = _CAP_LUT[key] = torch.where(bits.bool(), float("inf"), float("-inf")).to(
            dtype=dtype, device=bitmask.device)
    R = bitmask.shape[0]
    if sys.byteorder != "little":  # (the byte lookup reads bits 0-7 of a word as byte 0)
        allowed = unpack(bitmask, vocab_size)
        return torch.where(allowed, lut[1, 0], lut[0, 0])
    idx = bitmask.contiguous().view(torch.uint8).view(-1).to(torch.int32)  # (R * W * 4,)
    return lut.index_select(0, idx).view(R, -1)[:, :vocab_size]


class TokenMasks:
    """A step's masks, in buffers kept from step to step: for one engine (its vocabulary V
    and device). `apply(logits, seqs)` fills the bitmask rows of the constrained sequences
    and masks their rows of logits.

    The host side is one flat int32 buffer per arena, [R * W bitmask words | R row indices],
    pinned on CUDA: one non-blocking copy moves both to the device buffer. Two arenas in
    turn; an arena is rewritten only after the event recorded behind its last copy (with the
    engine's one step in flight it has long run: the wait costs nothing). Buffers grow (to
    twice the need) when a step has more constrained rows than they hold. `prepare` fills
    (on this thread), `launch` applies. graphs: the apply's copy + kernel replayed from CUDA
    graphs once steady (mask_graph.py; CUDA only; for engines whose logits sit in CUDA
    graphs' static buffers). fill_threads > 1: the fill runs on llguidance's pool of that
    many threads (the rows' grammars in as many lanes: grammar.py). `stats`: steps masked,
    rows masked, seconds the engine's thread spent filling, seconds launching the apply."""

    def __init__(self, vocab_size: int, device: torch.device | str, *, rows: int = 32,
                 graphs: bool = False, fill_threads: int = 1) -> None:
        self.vocab_size = vocab_size
        self.W = words(vocab_size)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._cap = max(1, rows) * (self.W + 1)
        self._host: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]  # made once, re-recorded
        self._recorded = [False, False]
        self._dev: torch.Tensor | None = None
        self._arena = 0
        self.graphs = MaskGraphs() if graphs and self.cuda else None
        self.argmax: torch.Tensor | None = None  # the last launch's greedy tokens (launch)
        self.fill_threads = fill_threads
        self._pool = None  # llguidance's LLExecutor, made by the first fill that uses it
        self.stats = {"steps": 0, "rows": 0, "fill_s": 0.0, "apply_s": 0.0}

    def _buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the next arena's host buffer, the device buffer), each >= n int32 words."""
        self._arena = a = 1 - self._arena
        if self._recorded[a]:
            self._events[a].synchronize()
            self._recorded[a] = False
        if n > self._cap:
            self._cap = 2 * n
            self._host, self._dev = [None, None], None
        if self._host[a] is None:
            self._host[a] = torch.empty(self._cap, dtype=torch.int32, pin_memory=self.cuda)
        if self.cuda and self._dev is None:
            self._dev = torch.empty(self._cap, dtype=torch.int32, device=self.device)
        return self._host[a], self._dev

    def apply(self, logits: torch.Tensor, seqs: Sequence) -> int:
        """logits (N, V) on this engine's device, row i for seqs[i]: the rows of sequences
        with a grammar (`seq.grammar`) are masked in place, the others untouched. Returns the
        number of rows masked."""
        return self.launch(logits, self.prepare(seqs))

    def _arena_for(self, seqs: Sequence) -> tuple | None:
        idx = [i for i, q in enumerate(seqs) if getattr(q, "grammar", None) is not None]
        if not idx:
            return None
        R, W = len(idx), self.W
        n = R * W + R
        host, dev = self._buffers(n)
        host.numpy()[R * W:n] = idx
        rows = host[:R * W].view(R, W)  # the (R, W) mask words, filled by the caller
        return [seqs[i].grammar for i in idx], rows, (R, n, self._arena, host, dev)

    def prepare(self, seqs: Sequence) -> tuple | None:
        """The host half, on this thread: the constrained rows of seqs are filled into the
        next arena. Returns what `launch` needs (None: no constrained row)."""
        t0 = time.perf_counter()
        got = self._arena_for(seqs)
        if got is None:
            return None
        states, rows, prepared = got
        if self._pool is None and self.fill_threads > 1 and len(states) >= POOL_MIN_ROWS:
            from .grammar import llg

            self._pool = llg().LLExecutor(self.fill_threads)
        fill_masks(states, rows, self._pool)
        self.stats["fill_s"] += time.perf_counter() - t0
        return prepared

    def launch(self, logits: torch.Tensor, prepared: tuple | None, *,
               argmax: bool | torch.Tensor = False) -> int:
        """The device half: one copy of the prepared arena, one kernel (CUDA); the torch
        reference on a CPU. Returns the number of rows masked. argmax: the caller samples
        every row greedily: when the apply replays from a CUDA graph, the graph also writes
        the masked rows' argmax (into this (N,) int64 tensor, or with True a buffer of the
        graph's), left in `self.argmax` (else None), so sampling launches nothing more."""
        self.argmax = None
        if prepared is None:
            return 0
        t1 = time.perf_counter()
        R, n, arena, host, dev = prepared
        W = self.W
        if self.cuda:
            if self.graphs is not None:  # (replayed from a CUDA graph when steady)
                self.argmax = self.graphs.run(logits, host, dev, R, n, W, argmax)
            else:
                plain(logits, host, dev, R, n, W)  # (checked shapes: straight in)
            ev = self._events[arena]  # behind the copy: the arena is free once it has run
            if ev is None:
                ev = self._events[arena] = torch.cuda.Event()
            ev.record()
            self._recorded[arena] = True
        else:
            every = R == logits.shape[0]  # every row in order: no index needed on a CPU
            apply_token_bitmask_(logits, host[:R * W].view(R, W), None if every else host[R * W:n])
        st = self.stats
        st["steps"] += 1
        st["rows"] += R
        st["apply_s"] += time.perf_counter() - t1
        return R


def mask_rows(rows: torch.Tensor, seqs: Sequence, masks: TokenMasks | None = None) -> None:
    """The engine's hook before sampling: rows (N, V) of logits, row i for seqs[i]; the rows
    of sequences with a grammar (`seq.grammar`) are masked in place, the others untouched.
    masks: the engine's TokenMasks (default: buffers made for this one call)."""
    if masks is None:
        if not any(getattr(q, "grammar", None) is not None for q in seqs):
            return
        masks = TokenMasks(rows.shape[-1], rows.device, rows=rows.shape[0])
    masks.apply(rows, seqs)


def mask_spec(items: Sequence) -> None:
    """The engine's hook before speculative verification: items are (ScheduledSeq, rows
    (1 + k, V)); a constrained sequence's rows are masked in place, row j for the state after
    its first j drafts, so a draft the grammar refuses has probability 0 and is rejected, and
    the correction is sampled from allowed tokens only."""
    for s, rows in items:
        state = getattr(s.seq, "grammar", None)
        if state is None:
            continue
        bitmask = allocate(rows.shape[0], rows.shape[-1])
        state.fill_drafts(bitmask.numpy(), list(s.spec_token_ids))
        apply_token_bitmask_(rows, bitmask)
