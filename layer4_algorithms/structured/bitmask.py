"""The token mask: which of the V tokens a constrained row may sample, applied to a batch.

A mask is a bitmask, 32 tokens per int32 word: row (W,) with W = ceil(V / 32), token t
allowed when bit t % 32 of word t // 32 is set (llguidance's and xgrammar's layout; 4 KB for
a 32k vocabulary instead of 32k bools). Per step:

    host    each constrained row's parser writes its row of a (R, W) int32 bitmask
            (llguidance walks its token trie against the lexer; ~10-100 us per row), in
            pinned memory, on llguidance's own threads
    copy    (R, W) to the device, non-blocking (R * W * 4 bytes: 16 KB at R = 32, V = 128k)
    apply   unpack to (R, V) bools and set the refused logits to -inf, in place

Rows without a grammar are not touched, and the mask acts on the logits after the forward
pass (outside a CUDA graph: the graph's output buffer is masked before it is sampled), so
greedy, temperature, top-k / top-p and speculative verification all draw only from allowed
tokens: masking a logit to -inf is exactly renormalising the distribution over the rest.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import llguidance

_EXECUTOR: llguidance.LLExecutor | None = None


def executor() -> llguidance.LLExecutor:
    """llguidance's thread pool for a batch's masks (made once, on first use)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        from .grammar import llg

        _EXECUTOR = llg().LLExecutor()
    return _EXECUTOR


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


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits (R, V) float, bitmask (R, W) int32 (any device): refused tokens -> -inf, in
    place; returns logits."""
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"need logits (R, V) and a bitmask (R, W); got {tuple(logits.shape)} "
                         f"and {tuple(bitmask.shape)}")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words covers "
                         f"{bitmask.shape[1] * 32} tokens, the logits have {logits.shape[1]}")
    mask = bitmask.to(logits.device, non_blocking=True)
    return logits.masked_fill_(~unpack(mask, logits.shape[1]), float("-inf"))


def fill_masks(states: Sequence, bitmask: torch.Tensor) -> None:
    """Row j of bitmask (R, W) int32 on the host <- states[j]'s allowed next tokens, the
    healthy ones in one call on llguidance's threads."""
    rows = bitmask.numpy()
    healthy = [(s.matcher, j) for j, s in enumerate(states)
               if not s.failed and not s.matcher.is_error()]
    if healthy:
        executor().unsafe_compute_mask_ptr(healthy, bitmask.data_ptr(), rows.shape[1] * 4,
                                           rows.shape[0])
    if len(healthy) < len(states):
        for j, s in enumerate(states):
            if s.failed or s.matcher.is_error():
                s.fill(rows[j])


def mask_rows(rows: torch.Tensor, seqs: Sequence) -> None:
    """The engine's hook before sampling: rows (N, V) of logits, row i for seqs[i]; the rows
    of sequences with a grammar (`seq.grammar`) are masked in place, the others untouched."""
    idx = [i for i, q in enumerate(seqs) if getattr(q, "grammar", None) is not None]
    if not idx:
        return
    V = rows.shape[-1]
    bitmask = allocate(len(idx), V, pin=rows.device.type == "cuda")
    fill_masks([seqs[i].grammar for i in idx], bitmask)
    if len(idx) == rows.shape[0]:
        apply_token_bitmask_(rows, bitmask)
        return
    where = torch.tensor(idx, dtype=torch.int64, device=rows.device)
    rows[where] = apply_token_bitmask_(rows[where], bitmask)


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
