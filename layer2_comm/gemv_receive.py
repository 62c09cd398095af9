"""The all-reduce's receive moved into the GEMV after it: no receive kernel between the GEMVs.

gemv_send.py lets the row-parallel GEMV (o_proj, down) send its outputs to the peers as LL
packets from its epilogue; what was left of the all-reduce was a kernel that polls and sums
(ll_receive_kernel), with a launch, a PDL boundary and a round trip of the sum through memory
of its own. Here the kernel that consumes the sum does it: gate_up's GEMV (RMSNorm + residual
prologue, after o_proj) and the next layer's qkv GEMV with RoPE and the cache write (after
down). Its programs request their first weight tiles, pass their PDL wait (the sender has
finished: its packets are on their way, its own y is in memory), then meet the sum:

  * one program, the first to arrive, polls every peer's packets for all the words, sums them
    with the sender's y in rank order (ll_receive_kernel's arithmetic: the same bits), stores
    the sum, and releases a ready flag (st.release after a CTA barrier);
  * every other program acquires that flag, then runs layer 1's prologue unchanged on the plain
    sum (the norm's statistics, program 0's new residual h), its act tiles unchanged.

Why one program receives, not each (polling the packets in every program): a program would
re-read K words x (W - 1) packets of 8 bytes from L2 besides its activations; gate_up at TP=2
is 3,584 programs of 4 rows, 3,584 x 32 KiB = 117 MB of packets, as much as its weights (117
MB a rank), and every act tile would have to read packets. One receiver costs one more L2 hop
(the flag) instead.

The receiver is elected, never appointed: "program 0" might not be resident yet (programs
start in no promised order, and a PDL dependent's programs may hold SMs), and one that waits
for a program that cannot start deadlocks. Each program first reads the flag (its lanes'
reads reduced to one answer, so the program takes one branch); where it is not yet set, it
swaps this call's epoch into an election word (an atomic exchange): the one that finds an
older value there is the receiver. It is running, so waiting for it is safe; it waits only
for the peers' senders (kernels that finished or will finish: the peer's sender waits for
nothing of ours, and a PDL dependent's programs only start once every program of the kernel
before has started), with the receive's timeout: a silent peer leaves its code in the status
word and the flag is released anyway, so nothing hangs. Programs that arrive after the flag
skip the election (later waves: no atomic).

The epoch. A call's flag is the sender's call count + 1 (gemv_send.py). The sender's program
0 also stores it into the sync words (EPOCH), which the receiving kernel reads after its PDL
wait: the counters themselves cannot be read there, as the receiver advances them (every
peer kernel advances every block's count on every call) while programs that have not yet
started would read them. The election and ready words hold the last call's epoch; epochs
only grow (signed differences: they may wrap), so nothing is ever reset, and a CUDA graph
replays the kernels any number of times.

The counter, halves and reuse (gemv_send.py's argument, the receive moved): the sender reads
block 0's count after its PDL wait; the kernel before it is the receiving GEMV of the call
before (or another peer kernel), finished by then, its receiver having advanced every block's
count before the flag's release. Reuse of a half: this rank writes half h of peer p's region
at call c only after its receive of call c-1 (the receiving GEMV's elected program) saw p's
packets of c-1, which p's sender stored after its PDL wait, that is after p's receive of c-2
(the last reader of half h, a receiving GEMV or a receive kernel) had finished.

The sum's buffer: the receiver stores it (the sum of N outputs, N even: whole words), the
programs' act tiles read it as the kernel's x, as the unfused GEMV reads the receive kernel's
output: the same bits in, the same bits out. Where a step cannot take this path (a bias, an
odd width, fp32 logits), PendingSum.receive() launches ll_receive_kernel as gemv_send does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

import layer1_kernels as kernels

from .gemv_send import ELECT, EPOCH, READY
from .peer_kernels import _floats_as_words, _ll_sum, _signal, _wait

_w_tile = kernels.GEMV_PARTS.w_tile
_act_tile = kernels.GEMV_PARTS.act_tile
_prologue = kernels.GEMV_PARTS.prologue
_first_tile = kernels.GEMV_PARTS.first_tile
_mac = kernels.GEMV_PARTS.mac

#: words of the sum one pass of the receiver handles (registers: a packet per peer per word)
RECEIVE_BLOCK = 1024


@triton.jit
def _receive(sum_ptr, mine_ptr, nwords, lls, state_ptr, nblocks, sync_ptr, status_addr,
             timeout_ns, slot_words, RANK: tl.constexpr, WORLD: tl.constexpr,
             KIND: tl.constexpr, RBLOCK: tl.constexpr, STATE_BLOCKS: tl.constexpr,
             THREADS: tl.constexpr):
    """After the PDL wait: the sum of my words (mine_ptr, the sender's y) and every peer's
    packets of this call in sum_ptr (nwords int32 words), done once, by the elected program;
    the others wait for its ready flag. See the module docstring."""
    pid = tl.program_id(0)
    expect = tl.load(sync_ptr + EPOCH)
    # the flag as one answer for the whole program (lanes may see it change between reads)
    seen = tl.load(sync_ptr + READY + tl.zeros([THREADS], dtype=tl.int32), volatile=True)
    late = tl.max(((seen - expect) < 0).to(tl.int32), 0)
    if late > 0:
        old = tl.atomic_xchg(sync_ptr + ELECT, expect, sem="relaxed")
        if old != expect:  # elected: receive for every program
            status_ptr = status_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
            half = ((expect - 1) % 2).to(tl.int64) * WORLD * slot_words
            for start in range(0, nwords, RBLOCK):
                offs = start + tl.arange(0, RBLOCK)
                mask = offs < nwords
                lo, hi = _ll_sum(mine_ptr, lls, half, offs, mask, expect, slot_words,
                                 timeout_ns, status_ptr, pid, RANK, WORLD, KIND)
                tl.store(sum_ptr + offs, _floats_as_words(lo, hi, KIND), mask=mask)
            tl.debug_barrier()  # every thread's stores, then the release
            _signal(sync_ptr + READY, expect)
            b = tl.arange(0, STATE_BLOCKS)  # this call done, on every block's counter
            tl.store(state_ptr + 2 * b, expect, mask=b < nblocks)
        else:  # thread 0 acquires the flag (a timeout names me: the receiver named the peer)
            _wait(sync_ptr + READY, expect, timeout_ns, status_addr, RANK + 1)
    tl.debug_barrier()  # nobody reads the sum before thread 0 has seen the flag


@triton.jit
def norm_gemv_receive_kernel(x_ptr, r_ptr, h_ptr, nw_ptr, w_ptr, y_ptr, N, stride_wn, eps,
                             sum_words, mine_words, lls, state_ptr, nblocks, sync_ptr,
                             status_addr, timeout_ns, slot_words,
                             K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             EVEN_K: tl.constexpr, STATS_K: tl.constexpr,
                             STAGES: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                             KIND: tl.constexpr, RBLOCK: tl.constexpr,
                             STATE_BLOCKS: tl.constexpr, THREADS: tl.constexpr,
                             PDL: tl.constexpr, PDL_EARLY: tl.constexpr):
    """y = rms_norm(h = x + residual) @ w^T, h into h_ptr (one row): layer 1's _gemv_kernel
    with the norm prologue step for step, x being the all-reduce's sum (x_ptr, K outputs; its
    words sum_words) that _receive makes first from my y (mine_words) and the peers' packets."""
    pid = tl.program_id(0)
    OUT_TY: tl.constexpr = x_ptr.dtype.element_ty
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, 1)
    m_ok = m < 1
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    w0 = _w_tile(w_rows, offs_k, n_ok, K, EVEN_K)  # before the PDL wait, as gemv
    _prologue(x_ptr, r_ptr, h_ptr, nw_ptr, 0, 0, m, m_ok, eps, K, 0, False, 1, STATS_K, OUT_TY,
              PDL, PDL_EARLY)  # the PDL part only (no norm): the sender has finished
    _receive(sum_words, mine_words, K // 2, lls, state_ptr, nblocks, sync_ptr, status_addr,
             timeout_ns, slot_words, RANK, WORLD, KIND, RBLOCK, STATE_BLOCKS, THREADS)
    rstd = _prologue(x_ptr, r_ptr, h_ptr, nw_ptr, 0, 0, m, m_ok, eps, K, 1, True, 1, STATS_K,
                     OUT_TY, False, False)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc, _ = _first_tile(acc, acc, w0, None, x_ptr, r_ptr, h_ptr, nw_ptr, 0, 0, m, m_ok, offs_k,
                         rstd, K, 1, True, pid == 0, OUT_TY, EVEN_K, 1)
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        k = k0 + offs_k
        w = _w_tile(w_rows, k, n_ok, K, EVEN_K)
        a = _act_tile(x_ptr, r_ptr, h_ptr, nw_ptr, 0, 0, m, m_ok, k, rstd, K, 1, True,
                      pid == 0, OUT_TY, EVEN_K)
        acc = _mac(acc, w, a, 1)
    if PDL and not PDL_EARLY:
        gdc_launch_dependents()
    out = tl.sum(acc, 1)[None, :]
    tl.store(y_ptr + m[:, None] * N + n[None, :], out.to(OUT_TY), mask=n_ok[None, :])


@triton.jit
def norm_gemv_rope_receive_kernel(x_ptr, r_ptr, h_ptr, nw_ptr, w_ptr, y_ptr,
                                  cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,
                                  table_stride, kc_stride_s, kc_stride_h, vc_stride_s,
                                  vc_stride_h, stride_wn, eps,
                                  sum_words, mine_words, lls, state_ptr, nblocks, sync_ptr,
                                  status_addr, timeout_ns, slot_words,
                                  K: tl.constexpr, N_PAIRS: tl.constexpr, HALF: tl.constexpr,
                                  HEAD_D: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr,
                                  BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                                  EVEN_K: tl.constexpr, STATS_K: tl.constexpr,
                                  STAGES: tl.constexpr, RANK: tl.constexpr,
                                  WORLD: tl.constexpr, KIND: tl.constexpr,
                                  RBLOCK: tl.constexpr, STATE_BLOCKS: tl.constexpr,
                                  THREADS: tl.constexpr, PDL: tl.constexpr,
                                  PDL_EARLY: tl.constexpr):
    """The qkv projection of gemv_rms_norm_rope (layer 1's _gemv_rope_kernel step for step, one
    row, no bias: RoPE on the q and k heads, k and v into the cache at the token's slot), x
    being the all-reduce's sum that _receive makes first, as norm_gemv_receive_kernel."""
    pid = tl.program_id(0)
    OUT_TY: tl.constexpr = y_ptr.dtype.element_ty
    j = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    j_ok = j < N_PAIRS
    head = j // HALF
    i = j % HALF
    n_lo = head * HEAD_D + i
    n_hi = n_lo + HALF
    m = tl.arange(0, 1)
    m_ok = m < 1
    offs_k = tl.arange(0, BLOCK_K)
    lo_rows = w_ptr + n_lo.to(tl.int64)[:, None] * stride_wn
    hi_rows = w_ptr + n_hi.to(tl.int64)[:, None] * stride_wn
    w_lo = _w_tile(lo_rows, offs_k, j_ok, K, EVEN_K)
    w_hi = _w_tile(hi_rows, offs_k, j_ok, K, EVEN_K)
    mask = m_ok[:, None] & j_ok[None, :]
    pos = tl.load(pos_ptr + m, mask=m_ok, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + m, mask=m_ok, other=0).to(tl.int64)[:, None]
    tab = pos[:, None] * table_stride + i[None, :]
    c = tl.load(cos_ptr + tab, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + tab, mask=mask, other=0.0).to(tl.float32)
    _prologue(x_ptr, r_ptr, h_ptr, nw_ptr, 0, 0, m, m_ok, eps, K, 0, False, 1, STATS_K, OUT_TY,
              PDL, PDL_EARLY)
    _receive(sum_words, mine_words, K // 2, lls, state_ptr, nblocks, sync_ptr, status_addr,
             timeout_ns, slot_words, RANK, WORLD, KIND, RBLOCK, STATE_BLOCKS, THREADS)
    rstd = _prologue(x_ptr, r_ptr, h_ptr, nw_ptr, 0, 0, m, m_ok, eps, K, 1, True, 1, STATS_K,
                     OUT_TY, False, False)
    acc_lo = tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.float32)
    acc_lo, acc_hi = _first_tile(acc_lo, acc_hi, w_lo, w_hi, x_ptr, r_ptr, h_ptr, nw_ptr, 0, 0,
                                 m, m_ok, offs_k, rstd, K, 1, True, pid == 0, OUT_TY, EVEN_K, 1)
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        k = k0 + offs_k
        w_lo = _w_tile(lo_rows, k, j_ok, K, EVEN_K)
        w_hi = _w_tile(hi_rows, k, j_ok, K, EVEN_K)
        a = _act_tile(x_ptr, r_ptr, h_ptr, nw_ptr, 0, 0, m, m_ok, k, rstd, K, 1, True, pid == 0,
                      OUT_TY, EVEN_K)
        acc_lo = _mac(acc_lo, w_lo, a, 1)
        acc_hi = _mac(acc_hi, w_hi, a, 1)
    if PDL and not PDL_EARLY:
        gdc_launch_dependents()
    lo = tl.sum(acc_lo, 1)[None, :].to(OUT_TY).to(tl.float32)
    hi = tl.sum(acc_hi, 1)[None, :].to(OUT_TY).to(tl.float32)
    rot = (head < NQ + NKV)[None, :]
    o_lo = tl.where(rot, lo * c - hi * s, lo).to(OUT_TY)
    o_hi = tl.where(rot, hi * c + lo * s, hi).to(OUT_TY)
    y_row = y_ptr + m[:, None] * (2 * N_PAIRS)
    tl.store(y_row + n_lo[None, :], o_lo, mask=mask)
    tl.store(y_row + n_hi[None, :], o_hi, mask=mask)
    is_k = ((head >= NQ) & (head < NQ + NKV))[None, :]
    kdst = kc_ptr + slot * kc_stride_s + (head - NQ)[None, :] * kc_stride_h + i[None, :]
    tl.store(kdst, o_lo, mask=mask & is_k)
    tl.store(kdst + HALF, o_hi, mask=mask & is_k)
    is_v = (head >= NQ + NKV)[None, :]
    vdst = vc_ptr + slot * vc_stride_s + (head - NQ - NKV)[None, :] * vc_stride_h + i[None, :]
    tl.store(vdst, o_lo, mask=mask & is_v)
    tl.store(vdst + HALF, o_hi, mask=mask & is_v)


class PendingSum:
    """The all-reduce of a row-parallel GEMV's outputs, sent (gemv_send_kernel ran) but not yet
    received: the next decode kernel receives it (norm_gemv / norm_gemv_rope: the sum inside
    gate_up's or qkv's GEMV), or receive() runs the receive kernel. It must be taken before the
    PeerAllReduce's next call (which settles it first: the counters stay in order). shape,
    dtype, device: those of the sum, (1, N)."""

    def __init__(self, ar, y: torch.Tensor, n: int) -> None:
        self._ar, self._y, self._n = ar, y, n
        self._out: torch.Tensor | None = None
        self.shape = torch.Size((1, n))
        self.dtype, self.device = y.dtype, y.device

    @property
    def taken(self) -> bool:
        return self._ar is None

    def receive(self) -> torch.Tensor:
        """The sum (1, N), through ll_receive_kernel (once; the same tensor again after)."""
        if self._out is None:
            if self.taken:
                raise RuntimeError("this sum was received inside a GEMV: use that GEMV's result")
            ar, self._ar = self._ar, None
            ar._pending = None
            self._out = ar._receive_launch(self._y)[:, :self._n]
        return self._out

    def _takes(self, w: torch.Tensor, norm_weight: torch.Tensor, residual, bias) -> bool:
        n = self._n
        return (not self.taken and bias is None and residual is not None and n % 2 == 0
                and w.dim() == 2 and w.shape[1] == n and w.dtype == self.dtype
                and w.stride(-1) == 1 and w.device == self.device
                and tuple(norm_weight.shape) == (n,) and norm_weight.device == self.device
                and tuple(residual.shape) == (1, n) and residual.dtype == self.dtype
                and residual.is_contiguous() and residual.device == self.device)

    def _launch_args(self):
        ar, self._ar = self._ar, None
        ar._pending = None
        sum_ = torch.empty((1, self._n), dtype=self.dtype, device=self.device)
        return ar, sum_, ar._receive_args(sum_, self._y)

    def norm_gemv(self, w: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None, bias: torch.Tensor | None = None):
        """layer 1's gemv_rms_norm(sum, w, norm_weight, eps, residual) -> (y (1, N'), h (1, N)),
        the sum received inside the GEMV; None where it cannot (then receive() and gemv)."""
        if not self._takes(w, norm_weight, residual, bias):
            return None
        parts = kernels.GEMV_PARTS
        N, K = w.shape
        block_n, block_k, warps, stages = parts.unpack(parts.config_for(N, K, 1))
        ar, sum_, extra = self._launch_args()
        y = torch.empty((1, N), dtype=self.dtype, device=self.device)
        h = torch.empty_like(sum_)
        norm_gemv_receive_kernel[(triton.cdiv(N, block_n),)](
            sum_, residual, h, norm_weight.contiguous(), w, y, N, w.stride(0), float(eps),
            *extra["args"], K=K, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0,
            STATS_K=parts.stats_k(K), STAGES=stages, THREADS=32 * warps, num_warps=warps,
            PDL_EARLY=parts.pdl_early(), **extra["consts"], **parts.pdl_launch(self.device))
        ar._after_receive()
        return y, h

    def norm_gemv_rope(self, w, norm_weight, eps, residual, bias, cos, sin, positions,
                       k_cache, v_cache, slots, n_q_heads: int, n_kv_heads: int, head_dim: int):
        """layer 1's gemv_rms_norm_rope (same arguments, x = the sum) -> (qkv (1, N'), h (1, N)),
        the sum received inside the GEMV; None where it cannot (then receive() and the GEMV)."""
        if not self._takes(w, norm_weight, residual, bias):
            return None
        N = (n_q_heads + 2 * n_kv_heads) * head_dim
        half = head_dim // 2
        if (w.shape[0] != N or head_dim % 2 or cos.dim() != 2 or cos.shape[1] != half
                or sin.shape != cos.shape or tuple(positions.shape) != (1,)
                or tuple(slots.shape) != (1,)
                or any(c.dim() != 3 or c.shape[1:] != (n_kv_heads, head_dim)
                       or c.dtype != self.dtype or c.stride(-1) != 1 for c in (k_cache, v_cache))):
            return None
        parts = kernels.GEMV_PARTS
        K = w.shape[1]
        block_p, block_k, warps, stages = parts.unpack(parts.rope_config_for(N, K))
        ar, sum_, extra = self._launch_args()
        y = torch.empty((1, N), dtype=self.dtype, device=self.device)
        h = torch.empty_like(sum_)
        cos_c, sin_c = cos.contiguous(), sin.contiguous()
        norm_gemv_rope_receive_kernel[(triton.cdiv(N // 2, block_p),)](
            sum_, residual, h, norm_weight.contiguous(), w, y, cos_c, sin_c, positions, slots,
            k_cache, v_cache, cos_c.stride(0), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), w.stride(0), float(eps), *extra["args"],
            K=K, N_PAIRS=N // 2, HALF=half, HEAD_D=head_dim, NQ=n_q_heads, NKV=n_kv_heads,
            BLOCK_P=block_p, BLOCK_K=block_k, EVEN_K=K % block_k == 0, STATS_K=parts.stats_k(K),
            STAGES=stages, THREADS=32 * warps, num_warps=warps, PDL_EARLY=parts.pdl_early(),
            **extra["consts"], **parts.pdl_launch(self.device))
        ar._after_receive()
        return y, h
