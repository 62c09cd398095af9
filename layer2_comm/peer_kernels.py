"""The Triton kernels of the peer-memory all-reduce: one-shot and two-shot, with their own barrier.

Every rank holds a buffer that every other GPU can read and write (torch symmetric memory maps
each peer's buffer into this GPU's address space over NVLink), and a small "signal pad" of
int32 flags, also mapped everywhere. The kernels get a tuple of pointers, one per rank, for
each, and move data with ordinary loads and stores: no NCCL, no host.

Ordering across GPUs (the whole difficulty). Data written to my buffer is only safe for a
peer to read once the peer knows the write is done, and the flag that tells it so must not
overtake the data. So a barrier is:
  1. every thread of the block finishes its stores (`tl.debug_barrier`, a CTA barrier),
  2. thread 0 release-stores a flag into each peer's signal pad (`st.release.sys`: every
     write the block made before becomes visible to the peer no later than the flag),
  3. thread 0 acquire-loads its own pad until each peer's flag has arrived
     (`ld.acquire.sys` in a spin loop: nothing after it is read before the flag),
  4. the block waits for thread 0 (`tl.debug_barrier` again).
Flags are per block: block b on every rank syncs with block b on the others only, for the
elements block b handles (the grid is the same on every rank, so the blocks line up).

Flags hold epochs, not 0/1. Each block keeps two counters in device memory beside the pad
(calls made, barriers passed); a barrier's flag is "barriers passed + 1" and the wait is for
`flag >= epoch` (wrap-safe: the signed difference). Nothing is ever reset, the host never
writes a flag, and the counters live on the GPU, so a CUDA graph can replay the kernel any
number of times: each replay reads the counters the previous one left.

Reuse across calls. One-shot has one barrier: after it, peers read my buffer for the rest of
the kernel. If my next call copied its input into the same buffer at once, a slow peer could
still be reading the old values. So one-shot alternates two halves of the buffer (by the
calls counter): by the time I write a half again, I have passed a barrier of the call in
between, which every peer entered only after finishing the kernel before it. Two-shot has a
second barrier before anyone reads data a peer wrote, so it needs no second half for itself,
but it uses the same alternation so the two kernels can follow each other in any order.

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


@triton.jit
def _wait(addr, value, timeout_ns, status_addr, code):
    """Thread 0: spin until the flag at `addr` reaches `value` (acquire), or until timeout_ns
    have passed, then store `code` into the status word and give up."""
    tl.inline_asm_elementwise(
        """{
        .reg .u32 %me, %v;
        .reg .s32 %d;
        .reg .u64 %t0, %t1;
        .reg .pred %p, %q;
        mov.u32 $0, 0;
        mov.u32 %me, %tid.x;
        setp.ne.u32 %p, %me, 0;
        @%p bra DONE;
        mov.u64 %t0, %globaltimer;
        SPIN:
        ld.acquire.sys.global.u32 %v, [$1];
        sub.s32 %d, %v, $2;
        setp.ge.s32 %q, %d, 0;
        @%q bra DONE;
        mov.u64 %t1, %globaltimer;
        sub.u64 %t1, %t1, %t0;
        setp.lt.u64 %q, %t1, $3;
        @%q bra SPIN;
        st.relaxed.sys.global.u32 [$4], $5;
        DONE:
        }""",
        "=r,l,r,l,l,r", [addr, value, timeout_ns, status_addr, code],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _barrier(pads, pid, epoch, timeout_ns, status_ptr, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Block `pid` of every rank meets here (see the module docstring for the ordering)."""
    tl.debug_barrier()  # every thread's stores are issued before the flags go out
    for p in tl.static_range(WORLD):
        if p != RANK:
            _signal(pads[p] + pid * WORLD + RANK, epoch)
    for p in tl.static_range(WORLD):
        if p != RANK:
            _wait(pads[RANK] + pid * WORLD + p, epoch, timeout_ns, status_ptr, p + 1)
    tl.debug_barrier()  # nobody reads peer data before thread 0 has seen every flag


@triton.jit
def _begin(state_ptr, status_addr, timeout_ns, half_elems):
    """This block's start of a call: (pid, grid, calls, epoch, half, status_ptr, timeout_ns).
    calls and epoch - 1 are the block's counters (calls made, barriers passed); half is the
    offset of the buffer half this call uses (alternating with calls)."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    calls = tl.load(state_ptr + 2 * pid)
    epoch = tl.load(state_ptr + 2 * pid + 1) + 1
    half = (calls % 2).to(tl.int64) * half_elems.to(tl.int64)
    status_ptr = status_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
    return pid, grid, calls, epoch, half, status_ptr, timeout_ns.to(tl.int64)


@triton.jit
def _end(state_ptr, pid, calls, epoch):
    """This block's end of a call: one more call made, `epoch` barriers passed."""
    tl.store(state_ptr + 2 * pid, calls + 1)
    tl.store(state_ptr + 2 * pid + 1, epoch)


@triton.jit
def _sum_over_ranks(x_ptr, bufs, half, offs, mask, RANK: tl.constexpr, WORLD: tl.constexpr,
                    BLOCK: tl.constexpr):
    """(BLOCK,) fp32: the elements `offs` summed over every rank's copy, in rank order (so all
    ranks get the same bits); my own contribution is read from x, the same bits as my copy."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(WORLD):
        if p == RANK:
            acc += tl.load(x_ptr + offs, mask=mask).to(tl.float32)
        else:
            acc += tl.load(bufs[p] + half + offs, mask=mask, cache_modifier=".cg").to(tl.float32)
    return acc


@triton.jit
def one_shot_kernel(x_ptr, out_ptr, numel, bufs, pads, state_ptr, status_addr, timeout_ns,
                    half_elems, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum over ranks of x. Each rank copies x into its buffer, meets the others, then
    reads every peer's copy and sums it: one barrier, (W-1) x n bytes read over NVLink.

    x_ptr, out_ptr: this rank's numel elements; bufs/pads: tuples of W pointers (rank order);
    state_ptr: int32[2 * grid] counters (calls, barriers) per block; status_addr: int32 word.
    """
    pid, grid, calls, epoch, half, status_ptr, timeout_ns = _begin(
        state_ptr, status_addr, timeout_ns, half_elems)
    lanes = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, numel, grid * BLOCK):
        offs = start + lanes
        mask = offs < numel
        tl.store(bufs[RANK] + half + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    _barrier(pads, pid, epoch, timeout_ns, status_ptr, RANK, WORLD)
    for start in range(pid * BLOCK, numel, grid * BLOCK):
        offs = start + lanes
        mask = offs < numel
        acc = _sum_over_ranks(x_ptr, bufs, half, offs, mask, RANK, WORLD, BLOCK)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    _end(state_ptr, pid, calls, epoch)


@triton.jit
def two_shot_kernel(x_ptr, out_ptr, numel, bufs, pads, state_ptr, status_addr, timeout_ns,
                    half_elems, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum over ranks of x, as reduce-scatter then all-gather through peer memory.

    The data is cut into tiles of W x BLOCK elements; rank r owns the r-th BLOCK of every
    tile. After the first barrier each rank sums its pieces over all peers' buffers and
    writes the sum into every peer's buffer (the all-gather by push); after the second, each
    rank copies the other ranks' pieces from its own buffer into out. Every link carries
    2 (W-1)/W x n bytes, as in a ring, in two barriers instead of 2 (W-1) steps.
    """
    pid, grid, calls, epoch, half, status_ptr, timeout_ns = _begin(
        state_ptr, status_addr, timeout_ns, half_elems)
    lanes = tl.arange(0, BLOCK)
    TILE: tl.constexpr = WORLD * BLOCK
    for start in range(pid * TILE, numel, grid * TILE):
        for r in tl.static_range(WORLD):
            if r != RANK:  # my own pieces nobody else reads: I sum them from x
                offs = start + r * BLOCK + lanes
                mask = offs < numel
                tl.store(bufs[RANK] + half + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    _barrier(pads, pid, epoch, timeout_ns, status_ptr, RANK, WORLD)
    for start in range(pid * TILE, numel, grid * TILE):
        offs = start + RANK * BLOCK + lanes
        mask = offs < numel
        acc = _sum_over_ranks(x_ptr, bufs, half, offs, mask, RANK, WORLD, BLOCK)
        total = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs, total, mask=mask)
        for p in tl.static_range(WORLD):
            if p != RANK:
                tl.store(bufs[p] + half + offs, total, mask=mask)
    _barrier(pads, pid, epoch + 1, timeout_ns, status_ptr, RANK, WORLD)
    for start in range(pid * TILE, numel, grid * TILE):
        for r in tl.static_range(WORLD):
            if r != RANK:
                offs = start + r * BLOCK + lanes
                mask = offs < numel
                got = tl.load(bufs[RANK] + half + offs, mask=mask, cache_modifier=".cg")
                tl.store(out_ptr + offs, got, mask=mask)
    _end(state_ptr, pid, calls, epoch + 1)


@triton.jit
def _first_tile(lo, pid, grid, BLOCK: tl.constexpr):
    """The first tile index >= lo // BLOCK that block pid owns (tile t belongs to t % grid)."""
    first = lo // BLOCK
    return first + (pid - first % grid + grid) % grid


@triton.jit
def all_gather_kernel(x_ptr, out_ptr, numel, bufs, pads, state_ptr, status_addr, timeout_ns,
                      half_elems, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """out[p * numel:(p + 1) * numel] = rank p's x, for every p: copy in, one barrier, read.

    The one-shot pattern with a copy instead of a sum: each rank reads (W-1) x numel elements
    from its peers. Tile t of x (BLOCK elements) is handled by block t % grid in both phases,
    so the barrier of block b covers exactly the tiles block b reads.
    """
    pid, grid, calls, epoch, half, status_ptr, timeout_ns = _begin(
        state_ptr, status_addr, timeout_ns, half_elems)
    lanes = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, numel, grid * BLOCK):
        offs = start + lanes
        mask = offs < numel
        v = tl.load(x_ptr + offs, mask=mask)
        tl.store(bufs[RANK] + half + offs, v, mask=mask)
        tl.store(out_ptr + RANK * numel + offs, v, mask=mask)
    _barrier(pads, pid, epoch, timeout_ns, status_ptr, RANK, WORLD)
    for start in range(pid * BLOCK, numel, grid * BLOCK):
        offs = start + lanes
        mask = offs < numel
        for p in tl.static_range(WORLD):
            if p != RANK:
                v = tl.load(bufs[p] + half + offs, mask=mask, cache_modifier=".cg")
                tl.store(out_ptr + p * numel + offs, v, mask=mask)
    _end(state_ptr, pid, calls, epoch)


@triton.jit
def reduce_scatter_kernel(x_ptr, out_ptr, numel, seg_lo, seg_hi, bufs, pads, state_ptr,
                          status_addr, timeout_ns, half_elems, RANK: tl.constexpr,
                          WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """out = x[seg_lo:seg_hi] summed over ranks (this rank's segment): copy in, one barrier,
    then sum my segment over every peer's buffer. Each rank reads (W-1)/W x numel elements.
    Only the elements outside my segment are copied in: nobody else reads mine."""
    pid, grid, calls, epoch, half, status_ptr, timeout_ns = _begin(
        state_ptr, status_addr, timeout_ns, half_elems)
    lanes = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, numel, grid * BLOCK):
        offs = start + lanes
        mask = (offs < numel) & ((offs < seg_lo) | (offs >= seg_hi))
        tl.store(bufs[RANK] + half + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    _barrier(pads, pid, epoch, timeout_ns, status_ptr, RANK, WORLD)
    for t in range(_first_tile(seg_lo, pid, grid, BLOCK), tl.cdiv(seg_hi, BLOCK), grid):
        offs = t * BLOCK + lanes
        mask = (offs >= seg_lo) & (offs < seg_hi)
        acc = _sum_over_ranks(x_ptr, bufs, half, offs, mask, RANK, WORLD, BLOCK)
        tl.store(out_ptr + (offs - seg_lo), acc.to(out_ptr.dtype.element_ty), mask=mask)
    _end(state_ptr, pid, calls, epoch)
