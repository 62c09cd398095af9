"""Lab 3 — the model: your answers.

Four exercises, in the order `lab3.ipynb` teaches them:

1. `rms_norm` — RMSNorm, with its statistics in fp32.
2. `apply_rope` — rotary position embeddings, applied to the queries or the keys.
3. `gqa_attention` — grouped-query attention over a KV cache: store this step's keys and
   values in the cache, then let every new query attend to every key up to its own position.
4. `top_p_filter` and `top_p_sample` — the nucleus sampler that picks the next token.

`lab3_forward.py` (read it) builds the whole course model out of exercises 1-3 and the
course model's trained weights; the grader checks its logits against layer3_model's for a
real prompt — a prefill, a prefill in chunks, and decode steps through your KV cache.

Write the code where it says YOUR CODE (each function raises NotImplementedError until you
do). Grade yourself with `stack grade --lab 3`.

Rules the grader enforces (see tests/labs/test_lab3.py):
* Plain PyTorch on CPU tensors: matmuls, softmax, sort, cumsum, multinomial are all fine.
  Two library shortcuts are refused while your function runs: `F.rms_norm` / `nn.RMSNorm`
  in exercise 1, and `F.scaled_dot_product_attention` in exercise 3.
* Do not import `layer3_model` (or `lab3_reference`) here: they hold the answers, and the
  grader refuses a file that imports them.
"""
from __future__ import annotations

import math  # noqa: F401 (for gqa_attention: math.sqrt)

import torch
import torch.nn.functional as F  # noqa: F401 (softmax, silu, ...)


# ---- Exercise 1: RMSNorm -----------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Root-mean-square normalisation over the last dimension, then a learned scale.

    x:      (..., H), any float dtype (fp32, bf16, fp16).
    weight: (H,), the learned per-channel gain (same dtype as x).
    eps:    added to the mean square before the square root (no division by zero).
    Returns (..., H) in x's dtype:

        y = weight * (x / sqrt(mean(x**2 over the last dim) + eps))

    Do the statistics in fp32 — cast x to float32, normalise, cast the normalised values
    back to x's dtype, *then* multiply by weight (Hugging Face's order; the grader
    compares with it). In fp16, x**2 overflows to inf as soon as |x| > 256: fp32 does not.
    Unlike LayerNorm there is no mean subtracted and no bias.
    """
    # YOUR CODE
    raise NotImplementedError("rms_norm")


# ---- Exercise 2: RoPE --------------------------------------------------------------------
def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding: rotate each query (or key) by an angle set by its position.

    x:         (T, heads, D), D even: T tokens' queries or keys, any float dtype.
    positions: (T,) int64, each token's position in its sequence (need not start at 0 or
               be consecutive).
    theta:     the base of the frequencies (the config's `rope_theta`: 10000 for the course
               model, 500000 for Llama 3).
    Returns a new (T, heads, D) tensor in x's dtype; x is left unchanged.

    With half = D // 2, dimension i < half is paired with dimension i + half (Llama's
    "rotate_half" layout, not adjacent pairs), and the pair of token t is rotated by the angle

        a[t, i] = positions[t] * inv_freq[i],    inv_freq[i] = 1 / theta ** (2i / D)

    computed as `1.0 / theta ** (torch.arange(0, D, 2).float() / D)`, in fp32:

        out[..., i]        = x[..., i] * cos(a) - x[..., i + half] * sin(a)
        out[..., i + half] = x[..., i + half] * cos(a) + x[..., i] * sin(a)

    The same angle applies to every head of a token. Compute in fp32 and cast back.
    Why: (R_m q) . (R_n k) depends only on m - n, so attention sees relative positions.
    """
    # YOUR CODE
    raise NotImplementedError("apply_rope")


# ---- Exercise 3: GQA attention with a KV cache ---------------------------------------------
def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, start: int, scale: float | None = None) -> torch.Tensor:
    """Causal grouped-query attention for T new tokens of one sequence, through its KV cache.

    q:       (T, Hq, D)  the new tokens' queries (RoPE already applied); the tokens sit at
                         positions start, start + 1, ..., start + T - 1.
    k, v:    (T, Hkv, D) their keys (RoPE applied) and values. Hq is a multiple of Hkv.
    k_cache, v_cache: (max_len, Hkv, D) this layer's cache: rows 0 .. start-1 hold the keys
                         and values of the tokens before these; rows from start + T on hold
                         garbage (maybe NaN) — never read them.
    start:   how many tokens are already in the cache (0 for the first prefill).
    scale:   multiplies the scores; None means 1 / sqrt(D).
    Returns (T, Hq, D) in q's dtype.

    1. Write k and v into rows start .. start+T-1 of the caches, in place (the caller keeps
       the cache for the next step: that is what makes decoding one token cheap).
    2. Read back keys and values 0 .. start+T-1 (S = start + T of them).
    3. For query head h use kv head h // (Hq // Hkv): G = Hq // Hkv query heads share one
       kv head (GQA; G = 1 is plain multi-head attention, Hkv = 1 multi-query).
       `repeat_interleave(G, dim=1)` on the keys and values does it (or a reshape).
    4. scores = q . k * scale, shape (Hq, T, S), computed in fp32. Query i sits at position
       start + i and may see keys 0 .. start + i only: set the others to -inf (causal mask).
    5. out = softmax(scores over S) @ v.
    With start = 0 this is a prefill; with T = 1 a decode step (no mask needed then: the
    one query sees every key).
    """
    # YOUR CODE
    raise NotImplementedError("gqa_attention")


# ---- Exercise 4: the sampler ----------------------------------------------------------------
def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus (top-p) filtering: keep the smallest set of most likely tokens whose
    probabilities add up to at least p, set every other logit to -inf.

    logits: (..., V) float. p: in (0, 1]; p = 1 keeps everything (return logits as is).
    Returns a new tensor of the same shape and dtype (the input is left unchanged).

    Per row: sort the probabilities (softmax of the logits, in fp32) in descending order.
    Token j of the sorted order is kept when the mass of the tokens ranked above it is still
    below p — so the most likely token is always kept, and the token that carries the
    total over p is kept too. Map the decision back to vocabulary order (`scatter`, or
    indexing with the sort's permutation).
    """
    # YOUR CODE
    raise NotImplementedError("top_p_filter")


def top_p_sample(logits: torch.Tensor, p: float = 1.0, temperature: float = 1.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw the next token of each row.

    logits:      (B, V) float.
    p:           top-p, in (0, 1].
    temperature: >= 0. 0 means greedy: the argmax of each row (p and generator unused).
    generator:   the random stream for torch.multinomial (a seeded generator must give the
                 same tokens every time).
    Returns (B,) int64 token ids.

    Otherwise: logits / temperature (in fp32), then top_p_filter with p, then draw from
    the softmax of what is left: `torch.multinomial(probs, 1, generator=generator)`.
    """
    # YOUR CODE
    raise NotImplementedError("top_p_sample")
