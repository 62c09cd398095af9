"""A row-parallel GEMV that sends its outputs to the peers as LL packets from its epilogue.

Tensor-parallel decode at batch 1 all-reduces the o_proj and down GEMVs' outputs: the GEMV
stores y, then the low-latency one-shot (peer_kernels.one_shot_ll_kernel) loads y, sends it to
every peer as packets, polls for the peers' packets and sums. Here the GEMV's programs send
their own outputs as soon as they have them (each program's few columns, while other programs
still stream weights), and the next kernel (peer_kernels.ll_receive_kernel) only polls and
sums: the send leaves the all-reduce's critical path, and one kernel's y round trip with it.
On by default (PeerAllReduce.gemv_send; LLM_STACK_TP_GEMV_SEND=0 turns it off): measured on 4x
H200, an all-reduce in a TP=2 decoder layer's batch-1 GEMV chain 3.04 -> 2.61 us over none.

No program waits here for anything. (Polling in the same kernel would deadlock: a program
waiting for peers' packets holds its SM while programs of the grid that are not yet resident,
on this GPU or a peer's, must run first.) The wait is the receive kernel's, a grid of its own.

The packets are the LL protocol's (see peer_kernels.py): a 32-bit word (two bf16/fp16 outputs)
and the call's flag in one 8-byte volatile store, into this rank's slot of every peer's LL
region, in the half the receiver expects. Flag and half come from the PeerAllReduce's call
counter (block 0's entry of its per-block state: every peer kernel advances every block's
count on every call, so all entries agree between kernels), read after the PDL wait: the
kernel before has finished by then, and so, transitively, has the previous peer kernel (every
PDL kernel waits before it exits). The receive kernel advances the counter at its end, as
every peer kernel does. Reuse of a half: this rank writes half h of peer p's region at call
c only after its receive kernel of call c-1 saw p's packets of c-1, which p's GEMV sent after
its PDL wait, that is after p's receive of c-2 (the last reader of half h) had finished.

y itself is stored too (the receiver sums its own words from it), padded to whole words: the
last word of an odd N carries a zero in its high half (the padding column's weights are
masked to zero), so y must hold N rounded up to even outputs.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

import layer1_kernels as kernels

from .peer_kernels import _store_volatile

_w_tile = kernels.GEMV_PARTS.w_tile
_act_tile = kernels.GEMV_PARTS.act_tile
_prologue = kernels.GEMV_PARTS.prologue
_mac = kernels.GEMV_PARTS.mac


@triton.jit
def _packets(out, flag, BLOCK_N: tl.constexpr):
    """(BLOCK_N,) 16-bit outputs -> (BLOCK_N // 2,) packets: flag | (high << 16) | low."""
    lo, hi = tl.split(tl.reshape(out, (BLOCK_N // 2, 2)))
    a = lo.to(tl.uint16, bitcast=True).to(tl.uint32)
    b = hi.to(tl.uint16, bitcast=True).to(tl.uint32)
    return flag | (a | (b << 16)).to(tl.int64)


@triton.jit
def gemv_send_kernel(x_ptr, w_ptr, y_ptr, N, stride_wn, lls, state_ptr, slot_words,
                     K: tl.constexpr, PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr,
                     RANK: tl.constexpr, WORLD: tl.constexpr, PDL: tl.constexpr,
                     PDL_EARLY: tl.constexpr):
    """y = a @ w^T for one row (a = x, or silu(gate) * up of x = [gate | up]: PROLOGUE 0 / 2),
    layer 1's _gemv_kernel step for step (same tiles, same bits), then y's words as packets
    into my slot of every peer's LL region. y: N rounded up to even outputs; lls: W int64
    pointers; slot_words: packets a slot holds. BLOCK_N even (a program's words are whole)."""
    pid = tl.program_id(0)
    OUT_TY: tl.constexpr = x_ptr.dtype.element_ty
    HALF_N: tl.constexpr = BLOCK_N // 2
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, 1)
    m_ok = m < 1
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    w0 = _w_tile(w_rows, offs_k, n_ok, K, EVEN_K)  # before the PDL wait, as gemv
    rstd = _prologue(x_ptr, x_ptr, x_ptr, x_ptr, 0, 0, m, m_ok, 0.0, K, PROLOGUE, False, 1, 16,
                     OUT_TY, PDL, PDL_EARLY)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    a = _act_tile(x_ptr, x_ptr, x_ptr, x_ptr, 0, 0, m, m_ok, offs_k, rstd, K, PROLOGUE, False,
                  False, OUT_TY, EVEN_K)
    acc = _mac(acc, w0, a, 1)
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        k = k0 + offs_k
        w = _w_tile(w_rows, k, n_ok, K, EVEN_K)
        a = _act_tile(x_ptr, x_ptr, x_ptr, x_ptr, 0, 0, m, m_ok, k, rstd, K, PROLOGUE, False,
                      False, OUT_TY, EVEN_K)
        acc = _mac(acc, w, a, 1)
    if PDL and not PDL_EARLY:  # the receive kernel may launch (it waits for us first)
        gdc_launch_dependents()
    out = tl.sum(acc, 1).to(OUT_TY)  # (BLOCK_N,); 0 past N (masked weights)
    nwords = (N + 1) // 2
    tl.store(y_ptr + n, out, mask=n < 2 * nwords)
    # the call this send belongs to: the counter the previous receive left (see the docstring)
    calls = tl.load(state_ptr)
    flag = (calls + 1).to(tl.int64) << 32
    half = (calls % 2).to(tl.int64) * WORLD * slot_words
    words = pid * HALF_N + tl.arange(0, HALF_N)
    packet = _packets(out, flag, BLOCK_N)
    for p in tl.static_range(WORLD):
        if p != RANK:
            _store_volatile(lls[p] + half + RANK * slot_words + words, packet, words < nwords)
