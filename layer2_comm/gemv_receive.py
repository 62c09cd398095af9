"""The all-reduce's receive moved into the GEMV after it: no receive kernel between the GEMVs.

gemv_send.py lets the row-parallel GEMV (o_proj, down) send its outputs to the peers as LL
packets from its epilogue; what was left of the all-reduce was a kernel that polls and sums
(ll_receive_kernel), with a launch, a PDL boundary and a round trip of the sum through memory
of its own. Here the kernel that consumes the sum does it: gate_up's GEMV (RMSNorm + residual
prologue, after o_proj) and the next layer's qkv GEMV with RoPE and the cache write (after
down). Its programs request their first weight tiles, pass their PDL wait (the sender has
finished: its packets are on their way, its own y is in memory), then meet the sum:

  * the sum is cut into chunks of two words a thread (CHUNK = 2 x THREADS words: 8 chunks of
    256 for the 8B shape's 4,096 outputs at 4 warps). A program takes a ticket (an atomic
    add); one below the chunk count is a chunk to receive: request every peer's packets of it
    at once, poll until all carry the call's flag, sum them with the sender's y in rank order
    (ll_receive_kernel's arithmetic: the same bits), store that slice of the sum, then count
    the chunk done (a CTA barrier, an acq_rel atomic add at gpu scope) and take another
    ticket. The program that counts the last chunk has seen every slice (its add acquired
    the others' releases) and release-stores the call's epoch into READY_COPIES copies of
    the ready flag, 128 bytes apart;
  * every program, takers included, waits for its copy of the flag (thread 0, acquire at
    gpu scope: this GPU wrote it), then runs layer 1's prologue unchanged on the plain sum
    (the norm's statistics, program 0's new residual h), its act tiles unchanged.

No program waits for one that might not run: a chunk is received by a program that holds a
ticket, so is running (programs start in no promised order, and a PDL dependent's programs
may hold SMs; "program 0" might not be resident yet). A taker waits only for the peers'
senders (kernels that finished or will finish: a peer's sender waits for nothing of ours),
with the receive's timeout: a silent peer leaves its code in the status word and the chunk
is counted anyway, so nothing hangs. Programs of later waves find no ticket left and the flag
set. Run one program at a time (Triton's interpreter), the first takes every chunk.

Why chunks, counted (8B shape, TP=2, gate_up: 2,048 words, 128 threads). The first form had
one elected program (an atomic exchange) receive everything and release one flag: its 128
threads polled 8 words each per peer in two passes of 1,024 words, each pass's peers one
after another (ll_receive's loop: a peer's next load waits for the last peer's packets), so
after the flag's read and the exchange it made 2 x (W - 1) polls in a row (2 at TP=2, 6 at
TP=4), each an L2 round trip at least; then a system-scope release (a fence that waits for
the sum's stores at system scope) of one flag that the thread 0 of every resident program
(>1,000 of gate_up's 3,584) polled with system-scope acquire loads, all on one 128-byte line:
the release queued behind them, and every poll round took as long as the queue. Measured on
4x H200 (TP=2 chain): 4.62 us an all-reduce over none against 2.61 for the send with the
receive kernel (whose 8 blocks each poll 2 words a thread: one round trip). Here: the ticket,
one poll round trip for all peers (they have usually landed: the senders finished), the done
count, the flag's release, one acquire; the chunks in parallel; gpu scope; the flag's
pollers spread over 16 lines.

The epoch, tickets and reuse. A call's flag is the sender's call count + 1 (gemv_send.py).
The sender's program 0 also stores it into the sync words (EPOCH) and zeroes the ticket and
done counts, after its PDL wait: every kernel before it has finished by then (each waits
before it exits), so the last receiving GEMV (the counts' last user) has; and the receiving
GEMV reads them only after its own PDL wait, when the sender has finished and its stores are
visible. So a call's counts start at 0 and nothing of an older call touches them. The flag's
copies hold the epoch of the last call received in a GEMV (older calls: smaller; the signed
difference, so they may wrap), never reset, so a CUDA graph replays the kernels any number
of times. The counters themselves cannot be read here (the takers advance them while
programs that have not yet started would read them): chunk 0's taker advances every block's
count to the epoch; the next peer kernel reads it after its PDL wait.

Reuse of a half (gemv_send.py's argument, the receive moved): this rank writes half h of
peer p's region at call c only after its receive of call c-1 (the chunks' takers of the
receiving GEMV) saw p's packets of c-1, which p's sender stored after its PDL wait, that is
after p's receive of c-2 (the last reader of half h, a receiving GEMV or a receive kernel)
had finished.

The sum's buffer: the takers store the sum (of N outputs, N even: whole words), the
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

from .gemv_send import DONE, EPOCH, READY, READY_COPIES, TICKET
from .peer_kernels import _floats_as_words, _globaltimer, _wait_ptx, _words_as_floats

_w_tile = kernels.GEMV_PARTS.w_tile
_act_tile = kernels.GEMV_PARTS.act_tile
_prologue = kernels.GEMV_PARTS.prologue
_first_tile = kernels.GEMV_PARTS.first_tile
_mac = kernels.GEMV_PARTS.mac


def chunk_words(threads: int) -> int:
    """Words of the sum one ticket receives: two a thread (one 16-byte load a peer)."""
    return 2 * threads


@triton.jit
def _release(addrs, value):
    """Each lane: release-store `value` at addrs (gpu scope: the readers are on this GPU)."""
    tl.inline_asm_elementwise(
        """{
        st.release.gpu.global.u32 [$1], $2;
        mov.u32 $0, 0;
        }""",
        "=r,l,r", [addrs, value], dtype=tl.int32, is_pure=False, pack=1)


# thread 0 waits for the flag at $1 (acquire at gpu scope) and gives up with code $5
WAIT_GPU_PTX = tl.constexpr(_wait_ptx("""
        setp.ne.u32 %p, %me, 0;
        @%p bra DONE;
        mov.u64 %a, $1;""", """
        st.relaxed.sys.global.u32 [$4], $5;""", scope="gpu"))


@triton.jit
def _wait(addr, value, timeout_ns, status_addr, code):
    """Thread 0: spin until the flag at `addr` reaches `value` (acquire, gpu scope), or until
    timeout_ns have passed, then store `code` into the status word and give up."""
    tl.inline_asm_elementwise(WAIT_GPU_PTX, "=r,l,r,l,l,r",
                              [addr, value, timeout_ns, status_addr, code],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _late(words, expect, mask, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Per peer (rank order, mine skipped): packets at masked lanes without `expect`'s flag."""
    late = ()
    for p in tl.static_range(WORLD):
        if p != RANK:
            late = late + (tl.sum((((words[p] >> 32).to(tl.int32) != expect) & mask)
                                  .to(tl.int32), 0),)
    return late


@triton.jit
def _poll_sum(mine_ptr, lls, half, offs, mask, expect, slot_words, timeout_ns, status_ptr, pid,
              RANK: tl.constexpr, WORLD: tl.constexpr, KIND: tl.constexpr):
    """peer_kernels._ll_sum's words and bits (fp32 sums in rank order, as (low, high)), but
    every peer's packets requested at once and polled together (_ll_sum polls one peer after
    another: W - 1 round trips at least). A timeout stores the first late peer's code."""
    mine = tl.load(mine_ptr + offs, mask=mask, other=0)
    t0 = _globaltimer(pid)
    words = ()
    for p in tl.static_range(WORLD):
        if p == RANK:
            words = words + (mine.to(tl.int64),)
        else:
            words = words + (tl.load(lls[RANK] + half + p * slot_words + offs, mask=mask,
                                     other=0, volatile=True),)
    late = _late(words, expect, mask, RANK, WORLD)
    left = 0
    for i in tl.static_range(WORLD - 1):
        left += late[i]
    waited = _globaltimer(pid) - t0
    while (left > 0) & (waited < timeout_ns):
        words = ()
        for p in tl.static_range(WORLD):
            if p == RANK:
                words = words + (mine.to(tl.int64),)
            else:
                words = words + (tl.load(lls[RANK] + half + p * slot_words + offs, mask=mask,
                                         other=0, volatile=True),)
        late = _late(words, expect, mask, RANK, WORLD)
        left = 0
        for i in tl.static_range(WORLD - 1):
            left += late[i]
        waited = _globaltimer(pid) - t0
    if left > 0:
        code = 0
        for p in tl.static_range(WORLD - 1, -1, -1):  # the first late peer's last
            if p != RANK:
                code = tl.where(late[p - (p > RANK)] > 0, p + 1, code)
        tl.store(status_ptr, code)
    lo, hi = _words_as_floats(words[0].to(tl.int32), KIND)
    for p in tl.static_range(1, WORLD):
        a, b = _words_as_floats(words[p].to(tl.int32), KIND)
        lo += a
        hi += b
    return lo, hi


@triton.jit
def _receive(sum_ptr, mine_ptr, nwords, lls, state_ptr, nblocks, sync_ptr, status_addr,
             timeout_ns, slot_words, RANK: tl.constexpr, WORLD: tl.constexpr,
             KIND: tl.constexpr, CHUNK: tl.constexpr, STATE_BLOCKS: tl.constexpr):
    """After the PDL wait: the sum of my words (mine_ptr, the sender's y) and every peer's
    packets of this call into sum_ptr (nwords int32 words), chunk by chunk by the programs
    that draw a ticket; then every program waits for the ready flag. See the module
    docstring."""
    pid = tl.program_id(0)
    expect = tl.load(sync_ptr + EPOCH)
    chunks = tl.cdiv(nwords, CHUNK)
    status_ptr = status_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
    half = ((expect - 1) % 2).to(tl.int64) * WORLD * slot_words
    t = tl.atomic_add(sync_ptr + TICKET, 1, sem="relaxed", scope="gpu")
    while t < chunks:
        offs = t * CHUNK + tl.arange(0, CHUNK)
        mask = offs < nwords
        lo, hi = _poll_sum(mine_ptr, lls, half, offs, mask, expect, slot_words, timeout_ns,
                           status_ptr, pid, RANK, WORLD, KIND)
        tl.store(sum_ptr + offs, _floats_as_words(lo, hi, KIND), mask=mask)
        if t == 0:  # this call done, on every block's counter
            b = tl.arange(0, STATE_BLOCKS)
            tl.store(state_ptr + 2 * b, expect, mask=b < nblocks)
        tl.debug_barrier()  # every thread's stores, then the count's release
        done = tl.atomic_add(sync_ptr + DONE, 1, sem="acq_rel", scope="gpu")
        if done == chunks - 1:  # the last chunk: every slice seen; the flag's copies
            _release(sync_ptr + READY + 32 * tl.arange(0, READY_COPIES), expect)
        t = tl.atomic_add(sync_ptr + TICKET, 1, sem="relaxed", scope="gpu")
    # thread 0 acquires its copy of the flag (a timeout names me: a taker named the peer)
    _wait(sync_ptr + READY + 32 * (pid % READY_COPIES), expect, timeout_ns, status_addr,
          RANK + 1)
    tl.debug_barrier()  # nobody reads the sum before thread 0 has seen the flag


@triton.jit
def norm_gemv_receive_kernel(x_ptr, r_ptr, h_ptr, nw_ptr, w_ptr, y_ptr, N, stride_wn, eps,
                             sum_words, mine_words, lls, state_ptr, nblocks, sync_ptr,
                             status_addr, timeout_ns, slot_words,
                             K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             EVEN_K: tl.constexpr, STATS_K: tl.constexpr,
                             STAGES: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                             KIND: tl.constexpr, CHUNK: tl.constexpr,
                             STATE_BLOCKS: tl.constexpr,
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
             timeout_ns, slot_words, RANK, WORLD, KIND, CHUNK, STATE_BLOCKS)
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
                                  CHUNK: tl.constexpr, STATE_BLOCKS: tl.constexpr,
                                  PDL: tl.constexpr,
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
             timeout_ns, slot_words, RANK, WORLD, KIND, CHUNK, STATE_BLOCKS)
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
            STATS_K=parts.stats_k(K), STAGES=stages, CHUNK=chunk_words(32 * warps), num_warps=warps,
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
            STAGES=stages, CHUNK=chunk_words(32 * warps), num_warps=warps,
            PDL_EARLY=parts.pdl_early(),
            **extra["consts"], **parts.pdl_launch(self.device))
        ar._after_receive()
        return y, h
