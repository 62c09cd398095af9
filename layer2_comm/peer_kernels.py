"""The Triton kernels of the peer-memory all-reduce: one-shot and two-shot, with their own barrier.

Every rank holds a buffer that every other GPU can read and write (torch symmetric memory maps
each peer's buffer into this GPU's address space over NVLink), and a small "signal pad" of
int32 flags, also mapped everywhere. The kernels get a tuple of pointers, one per rank, for
each, and move data with ordinary loads and stores: no NCCL, no host.

Ordering across GPUs (the whole difficulty). Data written to my buffer is only safe for a
peer to read once the peer knows the write is done, and the flag that tells it so must not
overtake the data. So a barrier is:
  1. every thread of the block finishes its stores (`tl.debug_barrier`, a CTA barrier),
  2. thread p of the block (p < W, p != my rank: one lane per peer, all in warp 0, in
     parallel) release-stores a flag into peer p's signal pad (`st.release.sys`: every write
     the block made before becomes visible to the peer no later than the flag),
  3. the same thread p acquire-loads my own pad until peer p's flag has arrived
     (`ld.acquire.sys` in a spin loop: nothing after it is read before the flag),
  4. the block waits for those threads (`tl.debug_barrier` again).
One lane per peer matters from 3 ranks up: a release store is a system-wide fence plus the
store, and the fence waits for the previous remote store to land, so one thread signalling
W-1 peers in turn pays W-1 NVLink round trips (3 `MEMBAR.SYS` in a row at W = 4), where the
lanes of one warp pay one. (Above 8 ranks the kernels fall back to thread 0 doing all of it.)
Flags are per block: block b on every rank syncs with block b on the others only, for the
elements block b handles (the grid is the same on every rank, so the blocks line up).

Blocks by size. The grid is always the same `grid` blocks (each keeps its own counters, see
below), but only the first `active` of them move data and take barriers, `active` = as many
as the message has passes of BLOCK elements (capped at grid): an 8 KiB message is one block
meeting its three peers, not 64 blocks each meeting them. The others only count the call.
`active` is the same on every rank (it depends on the size only), so block b's barriers
still pair up across ranks.

Flags hold epochs, not 0/1. Each block keeps two counters in device memory beside the pad
(calls made, barriers passed); a barrier's flag is "barriers passed + 1" and the wait is for
`flag >= epoch` (wrap-safe: the signed difference). Nothing is ever reset, the host never
writes a flag, and the counters live on the GPU, so a CUDA graph can replay the kernel any
number of times: each replay reads the counters the previous one left.

Reuse across calls. One-shot has one barrier: after it, peers read my buffer for the rest of
the kernel. If my next call copied its input into the same buffer at once, a slow peer could
still be reading the old values. So every kernel alternates two halves of the buffer (by the
calls counter, which every block of the grid advances on every call, active or not): by the
time I write a half again, I have passed a barrier of the call in between (block 0 is always
active), which every peer entered only after finishing the kernel before it. This holds
whatever the blocks' share of the data was in either call. Two-shot reads peers' buffers
after its last barrier too (its all-gather half pulls the owners' sums), so it relies on the
same alternation, and all the kernels can follow each other in any order.

A peer that never arrives. The spin loop reads `%globaltimer`; after `timeout_ns` it gives up,
writes 1 + the missing peer's rank into a status word (host memory, which the host reads
without waiting for the GPU) and carries on, so the kernel ends and nothing hangs. The result
of that call is garbage, and the caller's `check()` raises.

Peer data is loaded with `.cg` (cached in L2, not in this SM's L1): L1 is not coherent with
writes arriving over NVLink, so a line left there by an earlier call could be stale.
Sums accumulate in fp32 in rank order 0..W-1 on every rank, so all ranks get identical bits.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _signal(addr, value):
    """Thread 0: release-store `value` into one flag (a peer's pad, or mine)."""
    tl.inline_asm_elementwise(
        """{
        .reg .u32 %me;
        .reg .pred %p;
        mov.u32 %me, %tid.x;
        setp.eq.u32 %p, %me, 0;
        @%p st.release.sys.global.u32 [$1], $2;
        mov.u32 $0, 0;
        }""",
        "=r,l,r", [addr, value], dtype=tl.int32, is_pure=False, pack=1)


def _wait_ptx(who: str, give_up: str) -> str:
    """The PTX of a wait. `who` sends the threads that do not wait to DONE and points %a at
    the flag of those that do; they spin until the flag reaches $2 (acquire; the signed
    difference, so epochs may wrap) or until $3 ns have passed, then run `give_up` (store a
    code into the status word at $4) and carry on."""
    return """{
        .reg .u32 %me, %v;
        .reg .s32 %d;
        .reg .u64 %a, %t0, %t1;
        .reg .pred %p, %q;
        mov.u32 $0, 0;
        mov.u32 %me, %tid.x;""" + who + """
        mov.u64 %t0, %globaltimer;
        SPIN:
        ld.acquire.sys.global.u32 %v, [%a];
        sub.s32 %d, %v, $2;
        setp.ge.s32 %q, %d, 0;
        @%q bra DONE;
        mov.u64 %t1, %globaltimer;
        sub.u64 %t1, %t1, %t0;
        setp.lt.u64 %q, %t1, $3;
        @%q bra SPIN;""" + give_up + """
        DONE:
        }"""


# thread 0 waits for the flag at $1 and gives up with code $5
WAIT_PTX = tl.constexpr(_wait_ptx("""
        setp.ne.u32 %p, %me, 0;
        @%p bra DONE;
        mov.u64 %a, $1;""", """
        st.relaxed.sys.global.u32 [$4], $5;"""))


@triton.jit
def _wait(addr, value, timeout_ns, status_addr, code):
    """Thread 0: spin until the flag at `addr` reaches `value` (acquire), or until timeout_ns
    have passed, then store `code` into the status word and give up."""
    tl.inline_asm_elementwise(WAIT_PTX, "=r,l,r,l,l,r",
                              [addr, value, timeout_ns, status_addr, code],
                              dtype=tl.int32, is_pure=False, pack=1)


# The most ranks whose loads are issued together, before the first add or store (beyond: one
# after another; registers run short)
AT_ONCE = tl.constexpr(8)

# Lanes 0..7 of warp 0 each take one peer (all 8 pads are passed; lanes >= WORLD and my own
# rank's lane do nothing). A lane picks its peer's pad among the 8 operands by %tid.x.
PARALLEL_MAX_WORLD = 8
LANES = tl.constexpr(PARALLEL_MAX_WORLD)
# the PTX of _signal_lanes: $1..$8 the pads, $9 the value, $10 WORLD, $11 RANK; lane p takes $p+1
_PICK_PAD = "".join(f"""
        setp.eq.u32 %p, %me, {p};
        @%p mov.u64 %a, ${p + 1};""" for p in range(1, PARALLEL_MAX_WORLD))
SIGNAL_LANES_PTX = tl.constexpr("""{
        .reg .u32 %me;
        .reg .u64 %a;
        .reg .pred %p;
        mov.u32 $0, 0;
        mov.u32 %me, %tid.x;
        setp.ge.u32 %p, %me, $10;
        @%p bra SKIP;
        setp.eq.u32 %p, %me, $11;
        @%p bra SKIP;
        mov.u64 %a, $1;""" + _PICK_PAD + """
        st.release.sys.global.u32 [%a], $9;
        SKIP:
        }""")


@triton.jit
def _signal_lanes(addrs, value, WORLD: tl.constexpr, RANK: tl.constexpr):
    """Lane p < WORLD of warp 0 (p != RANK): release-store `value` at addrs[p] (peer p's flag;
    addrs: LANES pointers)."""
    tl.inline_asm_elementwise(SIGNAL_LANES_PTX, "=r,l,l,l,l,l,l,l,l,r,r,r",
                              addrs + (value, WORLD, RANK), dtype=tl.int32, is_pure=False, pack=1)


# lane p < $5 of warp 0, p != $6 (RANK), waits for its flag from peer p at $1 + 4p and gives
# up with code p + 1
WAIT_LANES_PTX = tl.constexpr(_wait_ptx("""
        setp.ge.u32 %p, %me, $5;
        @%p bra DONE;
        setp.eq.u32 %p, %me, $6;
        @%p bra DONE;
        mul.wide.u32 %a, %me, 4;
        add.u64 %a, %a, $1;""", """
        add.u32 %v, %me, 1;
        st.relaxed.sys.global.u32 [$4], %v;"""))


@triton.jit
def _wait_lanes(mine, value, timeout_ns, status_addr, WORLD: tl.constexpr, RANK: tl.constexpr):
    """Lane p < WORLD of warp 0 (p != RANK): spin until my flag from peer p (mine + p) reaches
    `value` (acquire), or until timeout_ns have passed, then store p + 1 into the status word."""
    tl.inline_asm_elementwise(WAIT_LANES_PTX, "=r,l,r,l,l,r,r",
                              [mine, value, timeout_ns, status_addr, WORLD, RANK],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _pad(pads, p: tl.constexpr, WORLD: tl.constexpr):
    """pads[p], or pads[0] for the lanes past the world (never used: those lanes skip)."""
    return pads[p if p < WORLD else 0]


@triton.jit
def _barrier(pads, pid, epoch, timeout_ns, status_ptr, RANK: tl.constexpr, WORLD: tl.constexpr,
             SERIAL: tl.constexpr):
    """Block `pid` of every rank meets here (see the module docstring for the ordering).
    SERIAL: thread 0 signals and waits for every peer in turn (the first version, kept to be
    measured against; the caller must pass it above PARALLEL_MAX_WORLD ranks)."""
    tl.debug_barrier()  # every thread's stores are issued before the flags go out
    if SERIAL:
        for p in tl.static_range(WORLD):
            if p != RANK:
                _signal(pads[p] + pid * WORLD + RANK, epoch)
        for p in tl.static_range(WORLD):
            if p != RANK:
                _wait(pads[RANK] + pid * WORLD + p, epoch, timeout_ns, status_ptr, p + 1)
    else:
        at = pid * WORLD + RANK
        addrs = ()
        for p in tl.static_range(LANES):
            addrs = addrs + (_pad(pads, p, WORLD) + at,)
        _signal_lanes(addrs, epoch, WORLD, RANK)
        _wait_lanes(pads[RANK] + pid * WORLD, epoch, timeout_ns, status_ptr, WORLD, RANK)
    tl.debug_barrier()  # nobody reads peer data before every peer's flag has been seen


@triton.jit
def _begin(state_ptr, status_addr, timeout_ns, half_elems):
    """This block's start of a call: (pid, calls, epoch, half, status_ptr, timeout_ns).
    calls and epoch - 1 are the block's counters (calls made, barriers passed); half is the
    offset of the buffer half this call uses (alternating with calls)."""
    pid = tl.program_id(0)
    calls = tl.load(state_ptr + 2 * pid)
    epoch = tl.load(state_ptr + 2 * pid + 1) + 1
    half = (calls % 2).to(tl.int64) * half_elems.to(tl.int64)
    status_ptr = status_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
    return pid, calls, epoch, half, status_ptr, timeout_ns.to(tl.int64)


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    """Under programmatic dependent launch (PDL: the decode kernels around it launch that way):
    wait for the kernel before to finish (its output is our input, and the buffers' reuse
    argument above needs it finished), then let the next kernel launch at once: its programs
    get onto the SMs and request their first weight tiles while we wait for the peers, and
    wait for us (griddepcontrol.wait) before they read what we write."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _end(state_ptr, pid, calls, barriers):
    """This block's end of a call: one more call made, `barriers` barriers passed in all."""
    tl.store(state_ptr + 2 * pid, calls + 1)
    tl.store(state_ptr + 2 * pid + 1, barriers)


@triton.jit
def _load_rank(x_ptr, bufs, half, offs, mask, p: tl.constexpr, RANK: tl.constexpr):
    """Rank p's copy of the elements `offs`: mine from x (the same bits as my copy), a peer's
    from its buffer (.cg: from L2, see the module docstring)."""
    if p == RANK:
        v = tl.load(x_ptr + offs, mask=mask)
    else:
        v = tl.load(bufs[p] + half + offs, mask=mask, cache_modifier=".cg")
    return v


@triton.jit
def _sum_over_ranks(x_ptr, bufs, half, offs, mask, RANK: tl.constexpr, WORLD: tl.constexpr,
                    BLOCK: tl.constexpr):
    """(BLOCK,) fp32: the elements `offs` summed over every rank's copy, in rank order (so all
    ranks get the same bits); my own contribution is read from x, the same bits as my copy.

    Every load is issued before the first add. A GPU issues in program order, so an add that
    needs peer 0's value stalls the thread until that value is back, and a load written after
    the add leaves only then: summing as it loads costs one NVLink round trip per peer and
    per 16-byte vector (6 in a row at 4 ranks, about 1 us each), loading first costs one.
    Up to 8 ranks are loaded this way; beyond, the rest one after another."""
    LOADED: tl.constexpr = WORLD if WORLD < AT_ONCE else AT_ONCE
    v = ()
    for p in tl.static_range(LOADED):
        v = v + (_load_rank(x_ptr, bufs, half, offs, mask, p, RANK),)
    acc = v[0].to(tl.float32)
    for p in tl.static_range(1, LOADED):
        acc += v[p].to(tl.float32)
    for p in tl.static_range(LOADED, WORLD):
        acc += _load_rank(x_ptr, bufs, half, offs, mask, p, RANK).to(tl.float32)
    return acc


@triton.jit
def _piece_load(x_ptr, bufs, half, start, lanes, numel, r: tl.constexpr, FROM: tl.constexpr,
                PIECE: tl.constexpr, RANK: tl.constexpr):
    """Piece r (elements start + r * PIECE + lanes): FROM 0 = from x, 1 = from rank r's
    buffer, 2 = from my own buffer."""
    offs = start + r * PIECE + lanes
    mask = offs < numel
    if FROM == 0:
        v = tl.load(x_ptr + offs, mask=mask)
    elif FROM == 1:
        v = tl.load(bufs[r] + half + offs, mask=mask, cache_modifier=".cg")
    else:
        v = tl.load(bufs[RANK] + half + offs, mask=mask, cache_modifier=".cg")
    return v


@triton.jit
def _piece_store(dst, v, start, lanes, numel, r: tl.constexpr, PIECE: tl.constexpr,
                 STRIDE):
    """Store piece r at dst + r * STRIDE + (start + r * PIECE + lanes)."""
    offs = start + r * PIECE + lanes
    tl.store(dst + r * STRIDE + offs, v, mask=offs < numel)


@triton.jit
def _copy_pieces(x_ptr, bufs, half, dst, start, lanes, numel, STRIDE, FROM: tl.constexpr,
                 PIECE: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Every piece r != RANK (r < WORLD) from its source (see _piece_load) to dst: all the
    loads first, then the stores (a store waits for its load; a load written after it would
    leave only then: one round trip per piece instead of one for all). Up to 8 ranks loaded
    together; beyond, one after another."""
    LOADED: tl.constexpr = WORLD if WORLD < AT_ONCE else AT_ONCE
    g = ()
    for r in tl.static_range(LOADED):
        if r != RANK:
            g = g + (_piece_load(x_ptr, bufs, half, start, lanes, numel, r, FROM, PIECE, RANK),)
        else:
            g = g + (0,)  # my own piece: nothing to move
    for r in tl.static_range(LOADED):
        if r != RANK:
            _piece_store(dst, g[r], start, lanes, numel, r, PIECE, STRIDE)
    for r in tl.static_range(LOADED, WORLD):
        if r != RANK:
            _piece_store(dst, _piece_load(x_ptr, bufs, half, start, lanes, numel, r, FROM, PIECE,
                                          RANK), start, lanes, numel, r, PIECE, STRIDE)


@triton.jit
def _copy_in(x_ptr, bufs, half, offs, numel, RANK: tl.constexpr, out_ptr=None, seg_lo=None,
             seg_hi=None):
    """The copy-in of the one-barrier kernels: the elements `offs` of x into my buffer (and
    into my slot of out when out_ptr is given), except those in [seg_lo, seg_hi) when given."""
    if seg_lo is None:
        mask = offs < numel
    else:
        mask = (offs < numel) & ((offs < seg_lo) | (offs >= seg_hi))
    if out_ptr is None:
        tl.store(bufs[RANK] + half + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    else:  # all-gather: my own slot of out as well
        v = tl.load(x_ptr + offs, mask=mask)
        tl.store(bufs[RANK] + half + offs, v, mask=mask)
        tl.store(out_ptr + RANK * numel + offs, v, mask=mask)


@triton.jit
def one_shot_kernel(x_ptr, out_ptr, numel, active, bufs, pads, state_ptr, status_addr,
                    timeout_ns, half_elems, RANK: tl.constexpr, WORLD: tl.constexpr,
                    BLOCK: tl.constexpr, SERIAL: tl.constexpr = False, PDL: tl.constexpr = False):
    """out = sum over ranks of x. Each rank copies x into its buffer, meets the others, then
    reads every peer's copy and sums it: one barrier, (W-1) x n bytes read over NVLink.

    x_ptr, out_ptr: this rank's numel elements; active: how many blocks of the grid work
    (pass b handles elements [b, b + active, ...] x BLOCK); bufs/pads: tuples of W pointers
    (rank order); state_ptr: int32[2 * grid] counters (calls, barriers) per block;
    status_addr: int32 word; PDL: see _pdl_start.
    """
    _pdl_start(PDL)
    pid, calls, epoch, half, status_ptr, timeout_ns = _begin(
        state_ptr, status_addr, timeout_ns, half_elems)
    if pid < active:
        lanes = tl.arange(0, BLOCK)
        for start in range(pid * BLOCK, numel, active * BLOCK):
            _copy_in(x_ptr, bufs, half, start + lanes, numel, RANK)
        _barrier(pads, pid, epoch, timeout_ns, status_ptr, RANK, WORLD, SERIAL)
        for start in range(pid * BLOCK, numel, active * BLOCK):
            offs = start + lanes
            mask = offs < numel
            acc = _sum_over_ranks(x_ptr, bufs, half, offs, mask, RANK, WORLD, BLOCK)
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        _end(state_ptr, pid, calls, epoch)
    else:
        _end(state_ptr, pid, calls, epoch - 1)


@triton.jit
def two_shot_kernel(x_ptr, out_ptr, numel, active, bufs, pads, state_ptr, status_addr,
                    timeout_ns, half_elems, RANK: tl.constexpr, WORLD: tl.constexpr,
                    BLOCK: tl.constexpr, SERIAL: tl.constexpr = False, PULL: tl.constexpr = True):
    """out = sum over ranks of x, as reduce-scatter then all-gather through peer memory.

    The data is cut into tiles of W x BLOCK elements; rank r owns the r-th BLOCK of every
    tile. After the first barrier each rank sums its pieces over all peers' buffers and
    writes the sum into out and into its own buffer; after the second, each rank reads the
    other owners' sums from their buffers into out (PULL). Every rank reads 2 (W-1)/W x n
    bytes from its peers, as much as a ring moves, in two barriers instead of 2 (W-1) steps.
    PULL=False is the first version: owners push their sums into every peer's buffer and
    each rank then copies them from its own buffer into out (the same NVLink bytes, written
    instead of read, plus a local copy of (W-1)/W x n).
    """
    pid, calls, epoch, half, status_ptr, timeout_ns = _begin(
        state_ptr, status_addr, timeout_ns, half_elems)
    if pid < active:
        lanes = tl.arange(0, BLOCK)
        TILE: tl.constexpr = WORLD * BLOCK
        for start in range(pid * TILE, numel, active * TILE):
            # the pieces the other owners read; my own nobody else reads: I sum them from x
            _copy_pieces(x_ptr, bufs, half, bufs[RANK] + half, start, lanes, numel, 0, 0,
                         BLOCK, RANK, WORLD)
        _barrier(pads, pid, epoch, timeout_ns, status_ptr, RANK, WORLD, SERIAL)
        for start in range(pid * TILE, numel, active * TILE):
            offs = start + RANK * BLOCK + lanes
            mask = offs < numel
            acc = _sum_over_ranks(x_ptr, bufs, half, offs, mask, RANK, WORLD, BLOCK)
            total = acc.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + offs, total, mask=mask)
            if PULL:
                tl.store(bufs[RANK] + half + offs, total, mask=mask)
            else:
                for p in tl.static_range(WORLD):
                    if p != RANK:
                        tl.store(bufs[p] + half + offs, total, mask=mask)
        _barrier(pads, pid, epoch + 1, timeout_ns, status_ptr, RANK, WORLD, SERIAL)
        for start in range(pid * TILE, numel, active * TILE):
            _copy_pieces(x_ptr, bufs, half, out_ptr, start, lanes, numel, 0, 1 if PULL else 2,
                         BLOCK, RANK, WORLD)
        _end(state_ptr, pid, calls, epoch + 1)
    else:
        _end(state_ptr, pid, calls, epoch - 1)


@triton.jit
def _first_tile(lo, pid, grid, BLOCK: tl.constexpr):
    """The first tile index >= lo // BLOCK that block pid owns (tile t belongs to t % grid)."""
    first = lo // BLOCK
    return first + (pid - first % grid + grid) % grid


@triton.jit
def all_gather_kernel(x_ptr, out_ptr, numel, active, bufs, pads, state_ptr, status_addr,
                      timeout_ns, half_elems, RANK: tl.constexpr, WORLD: tl.constexpr,
                      BLOCK: tl.constexpr, SERIAL: tl.constexpr = False):
    """out[p * numel:(p + 1) * numel] = rank p's x, for every p: copy in, one barrier, read.

    The one-shot pattern with a copy instead of a sum: each rank reads (W-1) x numel elements
    from its peers. Tile t of x (BLOCK elements) is handled by block t % active in both
    phases, so the barrier of block b covers exactly the tiles block b reads.
    """
    pid, calls, epoch, half, status_ptr, timeout_ns = _begin(
        state_ptr, status_addr, timeout_ns, half_elems)
    if pid < active:
        lanes = tl.arange(0, BLOCK)
        for start in range(pid * BLOCK, numel, active * BLOCK):
            _copy_in(x_ptr, bufs, half, start + lanes, numel, RANK, out_ptr)
        _barrier(pads, pid, epoch, timeout_ns, status_ptr, RANK, WORLD, SERIAL)
        for start in range(pid * BLOCK, numel, active * BLOCK):
            _copy_pieces(x_ptr, bufs, half, out_ptr, start, lanes, numel, numel, 1, 0, RANK, WORLD)
        _end(state_ptr, pid, calls, epoch)
    else:
        _end(state_ptr, pid, calls, epoch - 1)


@triton.jit
def reduce_scatter_kernel(x_ptr, out_ptr, numel, active, seg_lo, seg_hi, bufs, pads, state_ptr,
                          status_addr, timeout_ns, half_elems, RANK: tl.constexpr,
                          WORLD: tl.constexpr, BLOCK: tl.constexpr, SERIAL: tl.constexpr = False):
    """out = x[seg_lo:seg_hi] summed over ranks (this rank's segment): copy in, one barrier,
    then sum my segment over every peer's buffer. Each rank reads (W-1)/W x numel elements.
    Only the elements outside my segment are copied in: nobody else reads mine. Tile t
    (BLOCK elements of x) is block t % active's in both phases."""
    pid, calls, epoch, half, status_ptr, timeout_ns = _begin(
        state_ptr, status_addr, timeout_ns, half_elems)
    if pid < active:
        lanes = tl.arange(0, BLOCK)
        for start in range(pid * BLOCK, numel, active * BLOCK):
            _copy_in(x_ptr, bufs, half, start + lanes, numel, RANK, seg_lo=seg_lo,
                     seg_hi=seg_hi)
        _barrier(pads, pid, epoch, timeout_ns, status_ptr, RANK, WORLD, SERIAL)
        for t in range(_first_tile(seg_lo, pid, active, BLOCK), tl.cdiv(seg_hi, BLOCK), active):
            offs = t * BLOCK + lanes
            mask = (offs >= seg_lo) & (offs < seg_hi)
            acc = _sum_over_ranks(x_ptr, bufs, half, offs, mask, RANK, WORLD, BLOCK)
            tl.store(out_ptr + (offs - seg_lo), acc.to(out_ptr.dtype.element_ty), mask=mask)
        _end(state_ptr, pid, calls, epoch)
    else:
        _end(state_ptr, pid, calls, epoch - 1)


@triton.jit
def one_shot_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, rows, H, eps, active, bufs, pads,
                         state_ptr, status_addr, timeout_ns, half_elems, RANK: tl.constexpr,
                         WORLD: tl.constexpr, BLOCK_H: tl.constexpr, SERIAL: tl.constexpr = False,
                         PDL: tl.constexpr = False):
    """The one-shot all-reduce of a (rows, H) row-parallel output with the transformer block's
    next step in its epilogue: s = sum over ranks of x, h = s + residual, y = rms_norm(h) * w.
    Writes h (the new residual stream) and y (the next projection's input): one launch where
    the unfused block takes two (all-reduce, then the norm with its residual add), and s never
    goes to memory.

    Rows instead of flat tiles: the norm needs a whole row, so block b copies in, barriers on
    and sums rows b, b + active, ... (BLOCK_H >= H columns each). The arithmetic is the unfused
    kernels' step for step: s summed in fp32 in rank order and rounded to x's dtype (the
    all-reduce's output), h = round(s + residual), y = round(round(h * rstd) * w) (layer 1's
    rms_norm), so every rank gets the same bits and the same values as the two launches
    (up to the order of the sum of squares inside one block)."""
    _pdl_start(PDL)
    pid, calls, epoch, half, status_ptr, timeout_ns = _begin(
        state_ptr, status_addr, timeout_ns, half_elems)
    if pid < active:
        cols = tl.arange(0, BLOCK_H)
        cmask = cols < H
        for row in range(pid, rows, active):
            offs = row * H + cols
            tl.store(bufs[RANK] + half + offs, tl.load(x_ptr + offs, mask=cmask), mask=cmask)
        _barrier(pads, pid, epoch, timeout_ns, status_ptr, RANK, WORLD, SERIAL)
        dtype = x_ptr.dtype.element_ty
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        for row in range(pid, rows, active):
            offs = row * H + cols
            s = _sum_over_ranks(x_ptr, bufs, half, offs, cmask, RANK, WORLD, BLOCK_H).to(dtype)
            r = tl.load(res_ptr + offs, mask=cmask, other=0.0)
            h = (s.to(tl.float32) + r.to(tl.float32)).to(dtype)
            tl.store(h_ptr + offs, h, mask=cmask)
            hf = tl.where(cmask, h.to(tl.float32), 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / H + eps)
            y = (hf * rstd).to(dtype).to(tl.float32) * w
            tl.store(y_ptr + offs, y.to(dtype), mask=cmask)
        _end(state_ptr, pid, calls, epoch)
    else:
        _end(state_ptr, pid, calls, epoch - 1)


# ---- the low-latency one-shot: data and flag in one 8-byte store ----------------------------
# The barrier above costs a fence (the release store waits for my copy-in to land), a flag's
# trip to each peer and then a read of the peers' data: two NVLink latencies after the fence.
# NCCL's "LL" protocol needs one: each 4-byte word of data travels with a 4-byte flag in one
# 8-byte store (an aligned 8-byte access is never torn), straight into the receiver's buffer;
# the receiver polls its own memory until every word of its share carries this call's flag,
# then sums. No fence, no barrier, no remote read; the price is twice the bytes on the wire,
# which decode's few-KiB messages do not notice.
#
# Layout: every rank's LL region has two halves (alternating by call, as the buffers above)
# of WORLD slots, slot s holding what rank s sent: packet i = (flag << 32) | word i. The flag
# is the block's call count + 1, the same on every rank and never the value a stale packet of
# the same half holds (that one is two calls old). Reuse: by the time I write into a half of
# peer p again, I have received p's packets of the call in between (block 0 always works),
# which p sent only after finishing the call before it; every kernel here gives the same
# guarantee (a barrier with every peer, or received packets), so they may follow each other in
# any order, as above.


@triton.jit
def _globaltimer(dummy):
    """Nanoseconds (%globaltimer) as a scalar (dummy: any scalar, to give the op a shape)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dummy],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _store_volatile(ptrs, values, mask):
    """Each lane with mask set: one 8-byte st.volatile of values at ptrs (never split)."""
    tl.inline_asm_elementwise(
        """{
        .reg .pred %p;
        setp.ne.s32 %p, $3, 0;
        @%p st.volatile.global.b64 [$1], $2;
        mov.u32 $0, 0;
        }""",
        "=r,l,l,r", [ptrs, values, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _words_as_floats(w, KIND: tl.constexpr):
    """int32 words -> (low, high) fp32 values: two 16-bit floats a word (KIND 1 fp16, 2 bf16),
    or one fp32 (KIND 0: high is 0)."""
    if KIND == 0:
        return w.to(tl.float32, bitcast=True), tl.zeros_like(w).to(tl.float32)
    u = w.to(tl.uint32, bitcast=True)
    ty = tl.float16 if KIND == 1 else tl.bfloat16
    lo = (u & 0xFFFF).to(tl.uint16).to(ty, bitcast=True).to(tl.float32)
    hi = (u >> 16).to(tl.uint16).to(ty, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _floats_as_words(lo, hi, KIND: tl.constexpr):
    """The inverse of _words_as_floats, rounding to the 16-bit type (or fp32) once."""
    if KIND == 0:
        return lo.to(tl.int32, bitcast=True)
    ty = tl.float16 if KIND == 1 else tl.bfloat16
    a = lo.to(ty).to(tl.uint16, bitcast=True).to(tl.uint32)
    b = hi.to(ty).to(tl.uint16, bitcast=True).to(tl.uint32)
    return (a | (b << 16)).to(tl.int32, bitcast=True)


@triton.jit
def _ll_begin(state_ptr, slot_words, WORLD: tl.constexpr):
    """A block's start of an LL call: (pid, calls, barriers, expect, flag, half)."""
    pid = tl.program_id(0)
    calls = tl.load(state_ptr + 2 * pid)
    barriers = tl.load(state_ptr + 2 * pid + 1)
    expect = calls + 1
    half = (calls % 2).to(tl.int64) * WORLD * slot_words
    return pid, calls, barriers, expect, expect.to(tl.int64) << 32, half


@triton.jit
def _ll_send(x_ptr, lls, half, offs, mask, flag, slot_words, RANK: tl.constexpr,
             WORLD: tl.constexpr):
    """My words at offs, each with this call's flag, into my slot of every peer's region."""
    w = tl.load(x_ptr + offs, mask=mask, other=0)
    packet = flag | w.to(tl.uint32, bitcast=True).to(tl.int64)
    for p in tl.static_range(WORLD):
        if p != RANK:
            _store_volatile(lls[p] + half + RANK * slot_words + offs, packet, mask)


@triton.jit
def _ll_sum(x_ptr, lls, half, offs, mask, expect, slot_words, timeout_ns, status_ptr, pid,
            RANK: tl.constexpr, WORLD: tl.constexpr, KIND: tl.constexpr):
    """The words at offs summed over the ranks in rank order, fp32, as (low, high) values:
    mine from x, each peer's polled from its slot of my region until every packet carries
    `expect` (or timeout_ns have passed: then the peer's code into the status word)."""
    words = ()
    for p in tl.static_range(WORLD):
        if p == RANK:
            words = words + (tl.load(x_ptr + offs, mask=mask, other=0),)
        else:
            slot = lls[RANK] + half + p * slot_words + offs
            v = tl.load(slot, mask=mask, other=0, volatile=True)
            t0 = _globaltimer(pid)
            late = tl.sum((((v >> 32).to(tl.int32) != expect) & mask).to(tl.int32), 0)
            waited = _globaltimer(pid) - t0
            while (late > 0) & (waited < timeout_ns):
                v = tl.load(slot, mask=mask, other=0, volatile=True)
                late = tl.sum((((v >> 32).to(tl.int32) != expect) & mask).to(tl.int32), 0)
                waited = _globaltimer(pid) - t0
            if late > 0:
                tl.store(status_ptr, p + 1)
            words = words + (v.to(tl.int32),)
    lo, hi = _words_as_floats(words[0], KIND)
    for p in tl.static_range(1, WORLD):
        a, b = _words_as_floats(words[p], KIND)
        lo += a
        hi += b
    return lo, hi


@triton.jit
def _ll_receive(x_ptr, out_ptr, nwords, active, lls, half, expect, status_ptr, timeout_ns,
                slot_words, pid, lanes, RANK: tl.constexpr, WORLD: tl.constexpr,
                BLOCK: tl.constexpr, KIND: tl.constexpr):
    """Block pid's words [pid, pid + active, ...] x BLOCK (lanes: arange(BLOCK)): every peer's
    packets polled from my region (until timeout_ns, then a status code), summed with mine
    (x's) in rank order in fp32, stored to out. The receive half of an LL all-reduce, sent by
    this kernel or the one before."""
    for start in range(pid * BLOCK, nwords, active * BLOCK):
        offs = start + lanes
        mask = offs < nwords
        lo, hi = _ll_sum(x_ptr, lls, half, offs, mask, expect, slot_words, timeout_ns,
                         status_ptr, pid, RANK, WORLD, KIND)
        tl.store(out_ptr + offs, _floats_as_words(lo, hi, KIND), mask=mask)


@triton.jit
def one_shot_ll_kernel(x_ptr, out_ptr, nwords, active, lls, state_ptr, status_addr, timeout_ns,
                       slot_words, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                       KIND: tl.constexpr, PDL: tl.constexpr = False):
    """out = sum over ranks of x, x and out viewed as nwords int32 words (KIND: 0 fp32, 1 fp16,
    2 bf16 pairs). Block b sends words [b, b + active, ...] x BLOCK of x to every peer as
    packets, then polls its slots of my region for the same words from every peer (until
    timeout_ns, then a status code as the barrier's), and sums in rank order in fp32: the
    same bits as one_shot_kernel's. lls: W pointers (int64) to the ranks' LL regions;
    slot_words: packets a slot holds."""
    _pdl_start(PDL)
    pid, calls, barriers, expect, flag, half = _ll_begin(state_ptr, slot_words, WORLD)
    if pid < active:
        status_ptr = status_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
        lanes = tl.arange(0, BLOCK)
        for start in range(pid * BLOCK, nwords, active * BLOCK):
            offs = start + lanes
            _ll_send(x_ptr, lls, half, offs, offs < nwords, flag, slot_words, RANK, WORLD)
        _ll_receive(x_ptr, out_ptr, nwords, active, lls, half, expect, status_ptr, timeout_ns,
                    slot_words, pid, lanes, RANK, WORLD, BLOCK, KIND)
    _end(state_ptr, pid, calls, barriers)


@triton.jit
def ll_receive_kernel(y_ptr, out_ptr, nwords, active, lls, state_ptr, status_addr, timeout_ns,
                      slot_words, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                      KIND: tl.constexpr, PDL: tl.constexpr = False):
    """one_shot_ll_kernel's second half: the packets were sent by the kernel before (layer 2's
    gemv_send_kernel, from its epilogue, on every rank), so block b only polls its slots of my
    region for words [b, b + active, ...] x BLOCK from every peer and sums them with mine
    (y's, the sender's local copy) in rank order: the same bits as one_shot_ll_kernel's. Under
    PDL it waits for the sender first (y, and the counters it read), then lets the next GEMV
    launch, whose programs request their weights while this one polls."""
    _pdl_start(PDL)
    pid, calls, barriers, expect, flag, half = _ll_begin(state_ptr, slot_words, WORLD)
    if pid < active:
        status_ptr = status_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
        _ll_receive(y_ptr, out_ptr, nwords, active, lls, half, expect, status_ptr, timeout_ns,
                    slot_words, pid, tl.arange(0, BLOCK), RANK, WORLD, BLOCK, KIND)
    _end(state_ptr, pid, calls, barriers)
