"""Exact rejection sampling for speculative decoding (Leviathan et al. 2023, Chen et al. 2023).

A cheap proposer guesses k tokens x_1..x_k; one target pass over [last, x_1..x_k] gives the
target's distributions p_1..p_{k+1}. Walking left to right:

    accept x_j with probability min(1, p_j(x_j) / q_j(x_j))
    at the first rejection j: emit a token drawn from norm(max(0, p_j - q_j)) and stop
    if all k are accepted:    emit a bonus token drawn from p_{k+1}

Every emitted token is then distributed exactly as if the target had sampled it alone: the
accepted mass min(p, q) plus the residual max(0, p - q) add up to p. Special cases fall out
of the same formula:

* q one-hot (an n-gram guess, or a greedy draft): accept with probability p(x); on
  rejection draw from p with x removed (max(0, p - onehot(x)) = p with p(x) zeroed).
* greedy target (temperature 0): p is one-hot at argmax, so x is accepted iff it is the
  argmax, and the residual is that argmax: output identical to plain greedy decoding.

p and q are processed the same way (temperature, top-k, top-p; layer 3's filters) before the
test. `verify_input_ids` and `verify_logits` build the target pass and cut its logits into
(B, k+1, V). Everything is vectorised over the batch B and the k positions; only the uniform draws
loop over rows, because each request owns its torch.Generator (a seeded request gets the
same tokens whatever else shares its batch).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from layer3_model import SamplingParams, top_k_filter, top_p_filter

from .proposal import Proposal

Generators = torch.Generator | Sequence[torch.Generator | None] | None


def verify_input_ids(last_tokens: Sequence[int],
                     proposal: Proposal) -> tuple[torch.Tensor, list[int]]:
    """The flat verify batch: sequence b feeds [last_tokens[b], its proposed tokens] ->
    (input_ids (T,), query_lens (B,) = 1 + num_tokens[b])."""
    dev = proposal.tokens.device
    n = proposal.num_tokens.tolist()
    block = torch.cat([torch.tensor(last_tokens, dtype=torch.int64, device=dev)[:, None],
                       proposal.tokens], dim=1)
    keep = torch.arange(proposal.k + 1, device=dev)[None, :] <= proposal.num_tokens.to(dev)[:, None]
    return block[keep], [m + 1 for m in n]


def verify_logits(logits: torch.Tensor, query_lens: Sequence[int], k: int) -> torch.Tensor:
    """Flat logits (T, V) of a verify pass -> (B, k+1, V): row b's position j holds the
    target's prediction after its j-th fed token. Positions past query_lens[b] repeat the
    last real one (never read: acceptance stops at num_tokens[b])."""
    q = torch.tensor(query_lens, device=logits.device)
    ends = q.cumsum(0)
    idx = (ends - q)[:, None] + torch.arange(k + 1, device=logits.device)[None, :]
    return logits[torch.minimum(idx, (ends - 1)[:, None])]


def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits (B, ..., V) -> fp32 probabilities (B, ..., V) after row b's sampling params:
    greedy rows one-hot at the argmax, others softmax(top_p(top_k(logits / T))). Rows with
    equal (temperature, top_k, top_p) are processed together (usually: the whole batch)."""
    if logits.shape[0] != len(params):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(params)} SamplingParams")
    groups: dict[tuple[float, int, float], list[int]] = {}
    for b, sp in enumerate(params):
        groups.setdefault((float(sp.temperature), sp.top_k, float(sp.top_p)), []).append(b)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for (temperature, top_k, top_p), rows in groups.items():
        idx = torch.tensor(rows, device=logits.device) if len(rows) < len(params) else slice(None)
        x = logits[idx].float()
        if temperature == 0:
            probs = torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
        else:
            probs = torch.softmax(top_p_filter(top_k_filter(x / temperature, top_k), top_p), dim=-1)
        out[idx] = probs
    return out


def draw_uniforms(generators: Generators, batch: int, n: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """(batch, n) uniforms in [0, 1): row b from generators[b] (its own stream), or all rows
    from one generator, or from torch's global generator when None."""
    if generators is None or isinstance(generators, torch.Generator):
        return torch.rand(batch, n, generator=generators, device=device)
    if len(generators) != batch:
        raise ValueError(f"{len(generators)} generators for {batch} rows")
    return torch.stack([torch.rand(n, generator=g, device=device) for g in generators])


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs (..., V) (need not sum to 1), uniforms (...) -> ids (...).
    Picks the first token whose cumulative mass exceeds u * total, so a zero-probability
    token is never chosen; a row with no mass at all gives its argmax (0)."""
    cdf = probs.cumsum(-1)
    target = uniforms[..., None] * cdf[..., -1:]
    ids = torch.searchsorted(cdf, target, right=True)[..., 0]
    # u * total rounds up to total only with float error: fall back to the most likely token.
    return torch.where(ids < probs.shape[-1], ids, probs.argmax(-1))


@dataclass
class Acceptance:
    """The outcome of verifying one batch of proposals.

    tokens (B, K+1) int64: sequence b emits tokens[b, :num_accepted[b] + 1] (its accepted
    draft tokens, then the correction or bonus token); the rest is -1.
    num_accepted (B,) int64: draft tokens accepted, 0..num_proposed[b]."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor

    def emitted(self) -> list[list[int]]:
        """Per sequence, the tokens to append, as Python lists."""
        n = (self.num_accepted + 1).tolist()
        return [row[:m] for row, m in zip(self.tokens.tolist(), n, strict=True)]


def _finish(draft_tokens: torch.Tensor, num_accepted: torch.Tensor,
            final: torch.Tensor) -> Acceptance:
    B, K = draft_tokens.shape
    cols = torch.arange(K + 1, device=draft_tokens.device)
    padded = torch.cat([draft_tokens, draft_tokens.new_zeros(B, 1)], dim=1)
    tokens = torch.where(cols < num_accepted[:, None], padded, -1)
    tokens[torch.arange(B, device=tokens.device), num_accepted] = final
    return Acceptance(tokens=tokens, num_accepted=num_accepted)


def _leading_run(accept: torch.Tensor) -> torch.Tensor:
    """(B, K) bool -> (B,) length of each row's leading run of True (accepted before the
    first miss)."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def rejection_sample(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                     num_proposed: torch.Tensor,
                     draft_probs: torch.Tensor | None, uniforms: torch.Tensor) -> Acceptance:
    """The accept/reject walk for a batch, vectorised.

    target_probs (B, K+1, V): processed target distributions at the K+1 verified positions.
    draft_tokens (B, K) int64; num_proposed (B,): row b proposed only its first num_proposed[b]
    (the rest is padding, treated as rejected with q = 0, so the residual there is p itself).
    draft_probs (B, K, V) processed draft distributions q, or None for one-hot q
    (deterministic proposals: n-gram, or a greedy draft). uniforms (B, K+1) in [0, 1):
    columns 0..K-1 for the accept tests, column K for the final draw.
    """
    B, K = draft_tokens.shape
    if target_probs.shape[:2] != (B, K + 1):
        raise ValueError(f"target_probs must be (B, K+1, V) = ({B}, {K + 1}, V), got "
                         f"{tuple(target_probs.shape)}")
    dev = target_probs.device
    valid = torch.arange(K, device=dev)[None, :] < num_proposed[:, None]  # (B, K)
    p = target_probs[:, :K]
    p_x = p.gather(-1, draft_tokens[..., None])[..., 0]  # (B, K)
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
    # u < p/q written as u * q < p: no division, and q = 0 (never sampled) cannot make inf.
    accept = (uniforms[:, :K] * q_x < p_x) & valid
    num_accepted = _leading_run(accept)

    rows = torch.arange(B, device=dev)
    p_at = target_probs[rows, num_accepted]  # (B, V): where the final token is drawn
    proposed_there = num_accepted < num_proposed  # a rejection (else: the bonus position)
    at = num_accepted.clamp(max=max(K - 1, 0))
    if K == 0:
        residual = p_at
    elif draft_probs is None:
        # max(0, p - onehot(x)) = p with x's mass removed
        x = draft_tokens[rows, at]
        residual = p_at.scatter(-1, x[:, None], 0.0)
        residual = torch.where(proposed_there[:, None], residual, p_at)
    else:
        q_at = draft_probs[rows, at]
        residual = torch.where(proposed_there[:, None], (p_at - q_at).clamp(min=0), p_at)
    # p == q up to rounding can leave no residual mass; the rejection then had probability ~0
    # and p itself is the right distribution to draw from.
    empty = residual.sum(-1, keepdim=True) <= 1e-12
    residual = torch.where(empty, p_at, residual)
    final = sample_from_probs(residual, uniforms[:, K])
    return _finish(draft_tokens, num_accepted, final)


def greedy_accept(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                  num_proposed: torch.Tensor) -> Acceptance:
    """Temperature 0 for the whole batch: accept the leading draft tokens equal to the target's
    argmax, then emit the argmax at the first mismatch (or the bonus position). The same
    result as rejection_sample with one-hot p and q, without building (B, K+1, V) probabilities."""
    B, K = draft_tokens.shape
    best = target_logits.argmax(-1)  # (B, K+1)
    valid = torch.arange(K, device=best.device)[None, :] < num_proposed[:, None]
    num_accepted = _leading_run((draft_tokens == best[:, :K]) & valid)
    final = best[torch.arange(B, device=best.device), num_accepted]
    return _finish(draft_tokens, num_accepted, final)


def accept_proposals(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                     num_proposed: torch.Tensor,
                     draft_probs: torch.Tensor | None, params: Sequence[SamplingParams],
                     generators: Generators) -> Acceptance:
    """From raw target logits (B, K+1, V): greedy batches take the argmax path; otherwise p is
    processed with each row's params and rejection_sample runs with fresh uniforms (greedy
    rows consume none: their walk does not depend on them)."""
    if all(sp.greedy for sp in params) and draft_probs is None:
        return greedy_accept(target_logits, draft_tokens, num_proposed)
    B, K1 = target_logits.shape[:2]
    uniforms = torch.zeros(B, K1, device=target_logits.device)
    sampled = [b for b, sp in enumerate(params) if not sp.greedy]
    if sampled:
        gens = generators if generators is None or isinstance(generators, torch.Generator) \
            else [generators[b] for b in sampled]
        uniforms[sampled] = draw_uniforms(gens, len(sampled), K1, target_logits.device)
    probs = processed_probs(target_logits, params)
    return rejection_sample(probs, draft_tokens, num_proposed, draft_probs, uniforms)
