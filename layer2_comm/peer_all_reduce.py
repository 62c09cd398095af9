"""PeerAllReduce: an all-reduce of our own over NVLink peer memory, for decode-sized messages.

NCCL's ring is built for bandwidth: 2 (W-1) steps, each a handshake between neighbours, so a
few-KiB all-reduce costs tens of microseconds of latency. Tensor-parallel decode all-reduces a
few KiB to a few MiB twice per layer, where latency is everything. On one machine with NVLink
every GPU can load and store straight into every other GPU's memory, so:

- one-shot: every rank copies its input into its own shared buffer, all ranks meet at one
  barrier, and every rank reads all W buffers and sums them. One barrier; each rank reads
  (W-1) x n bytes from its peers. Best for small messages (and for W = 2 at every size: one
  peer, n bytes each way, the same as a ring moves).
- two-shot: reduce-scatter then all-gather through the same buffers: rank r sums its 1/W of
  the data over all buffers and writes the sum into every buffer, a second barrier, then
  every rank copies out. Two barriers; 2 (W-1)/W x n bytes per rank each way, as a ring, so it
  wins once (W-1) x n no longer fits in one barrier's time.
- above `max_bytes` (the registered buffer) NCCL's ring takes over.

The buffers are torch symmetric memory (`symm_mem.empty` + `rendezvous`: one allocation per
rank, mapped into every peer's address space, plus a signal pad of flags); the data movement
and the cross-GPU ordering are our Triton kernels (peer_kernels.py). Nothing waits on the
host: a call is one kernel launch, so it can be captured in a CUDA graph and replayed.

Errors. A rank that never arrives: the kernel's wait gives up after `timeout_s`, records which
peer was missing, and `check()` (or the next call, or every call with debug=True) raises
RuntimeError naming it. Mismatched sizes or dtypes across ranks: with debug=True every call
first swaps a small header with its peers (a host round trip) and raises ValueError naming
the ranks that disagree. Larger than the buffer: NCCL takes it (`algorithm` says "nccl").
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import layer1_kernels as kernels  # the layer beneath: the unfused norm

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
PDL_ENV = "LLM_STACK_PEER_PDL"  # "0" turns PeerAllReduce.pdl off (on by default)
LL_ENV = "LLM_STACK_PEER_LL"  # "0" turns PeerAllReduce.low_latency off (on by default)
# "0" turns PeerAllReduce.gemv_send off (on by default: measured, see gemv_send below)
GEMV_SEND_ENV = "LLM_STACK_TP_GEMV_SEND"
_LL_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ALGORITHMS = ("one_shot", "two_shot", "nccl")


def _need_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs CUDA peer access (GPUs that can read each other's "
                           "memory over NVLink or PCIe P2P); no CUDA GPU is visible here. On a "
                           "CPU use layer2_comm.simulated's one_shot_all_reduce / "
                           "two_shot_all_reduce over simulated ranks, or dist.all_reduce.")


# One barrier and one GPU's NVLink bandwidth, fitted on our one-shot times on 2x H100
# (`stack bench --layer 2 --peer`): the alpha-beta model's inputs for the choice.
BARRIER_S, NVLINK_BYTES_PER_S = 5.5e-6, 254e9


def default_one_shot_max_bytes(world: int) -> int:
    """Where two-shot takes over (bytes), from the alpha-beta model:
    one-shot  a + (W-1) n b  =  two-shot  2a + 2 (W-1)/W n b   at  n = a / (b (W-1)(1 - 2/W)).
    With 2 ranks both move n bytes each way and one-shot has a barrier fewer: it keeps every
    size (measured: two-shot is within 3 % of it from 16 MiB up). For more ranks this is the
    model's prediction (about 900 KiB for 4, 260 KiB for 8); on 4x H200 one-shot was measured
    fastest up to 512 KiB and two-shot from 2 MiB (kernels before the lane-per-peer barrier),
    so 900 KiB falls in the measured gap."""
    if world <= 2:
        return 1 << 62
    return int(BARRIER_S * NVLINK_BYTES_PER_S / ((world - 1) * (1 - 2 / world)))


def choose(nbytes: int, world: int, max_bytes: int = 8 << 20, one_shot_max_bytes: int | None = None,
           dtype: torch.dtype = torch.bfloat16) -> str:
    """The choice by size: "one_shot" | "two_shot" | "nccl" for `nbytes` over `world` ranks."""
    if nbytes > max_bytes or dtype not in FLOATS:
        return "nccl"
    limit = default_one_shot_max_bytes(world) if one_shot_max_bytes is None else one_shot_max_bytes
    return "one_shot" if nbytes <= limit else "two_shot"


class PeerAllReduce:
    """Sum a CUDA tensor over the ranks of `group` with our one-shot / two-shot kernels.

    Collective: every rank of the group constructs it (it allocates and exchanges buffers)
    and calls it with a tensor of the same size and dtype. `max_bytes` is the largest message
    the peer kernels take (two buffers of that size per rank are registered); larger
    messages, and dtypes other than float32/float16/bfloat16, go to NCCL.

    x: any shape, contiguous or not; returns `out` (or a new tensor) with the sum, same shape
    and dtype (`out` may be `x`). Capturable in a CUDA graph: the kernel reads and advances its
    own counters on the GPU. Call it once eagerly per dtype before capturing (Triton compiles
    on the first call), and let every rank capture and replay the same sequence of calls.
    """

    def __init__(self, group=None, max_bytes: int = 8 << 20, device=None, *,
                 one_shot_max_bytes: int | None = None, timeout_s: float = 30.0,
                 debug: bool = False, blocks: int | None = None, num_warps: int = 16) -> None:
        _need_cuda("PeerAllReduce")
        if not dist.is_initialized():
            raise RuntimeError("PeerAllReduce is collective: call it inside a process group "
                               "(layer2_comm.init() under torchrun or launch())")
        if not isinstance(max_bytes, int) or max_bytes < 32:
            raise ValueError(f"max_bytes must be an int >= 32, got {max_bytes!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        import torch.distributed._symmetric_memory as symm_mem

        from . import symmetric_group

        self.device = torch.device(device) if device is not None else \
            torch.device("cuda", torch.cuda.current_device())
        if self.device.type != "cuda":
            raise RuntimeError(f"PeerAllReduce needs CUDA peer access; device {self.device} is not "
                               "a CUDA device")
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.max_bytes = -(-max_bytes // 32) * 32  # whole 16-byte vectors in every dtype
        self.one_shot_max_bytes = (default_one_shot_max_bytes(self.world)
                                   if one_shot_max_bytes is None else int(one_shot_max_bytes))
        self.timeout_s, self.debug, self.num_warps = float(timeout_s), bool(debug), num_warps
        # the rendezvous runs over a group of its own: this process may have rendezvoused
        # before and the others not (see symmetric_group.py)
        self._symmetric = symmetric_group.rendezvous_group(self.group, self.device)
        # the low-latency one-shot's region after the buffers: two halves of W slots, each
        # LL_SLOT_BYTES of data as 8-byte packets (see peer_kernels.py), made at construction
        self._ll_slot_words = self.LL_SLOT_BYTES // 4 if self.low_latency else 0
        ll_bytes = 2 * self.world * self._ll_slot_words * 8
        try:
            # two halves: one-shot alternates between them (see peer_kernels.py)
            self._storage = symm_mem.empty(2 * self.max_bytes + ll_bytes, dtype=torch.uint8,
                                           device=self.device)
            if ll_bytes:  # no stale memory may look like a packet of the first calls; done
                # before the rendezvous, which no peer passes (and then writes here) before us
                self._storage[2 * self.max_bytes:].zero_()
                torch.cuda.synchronize(self.device)
            self._handle = symm_mem.rendezvous(self._storage, self._symmetric)
        except Exception as exc:
            raise RuntimeError(f"rank {self.rank}: PeerAllReduce needs CUDA peer access between "
                               f"the group's {self.world} GPUs, and torch symmetric memory could "
                               f"not map them: {exc}") from exc
        pad_ints = self._handle.signal_pad_size // 4
        if blocks is None:  # measured on 2x H100: 64 for decode sizes, 128 to fill NVLink
            blocks = 64 if self.max_bytes <= 8 << 20 else 128
        self.blocks = max(1, min(blocks, pad_ints // max(1, self.world)))
        self._pads = tuple(self._handle.get_signal_pad(r, (pad_ints,), torch.int32)
                           for r in range(self.world))
        self._views: dict[torch.dtype, tuple[torch.Tensor, ...]] = {}
        self._lls = tuple(self._handle.get_buffer(r, (ll_bytes // 8,), torch.int64,
                                                  storage_offset=2 * self.max_bytes // 8)
                          for r in range(self.world)) if ll_bytes else ()
        self._state = torch.zeros(2 * self.blocks, dtype=torch.int32, device=self.device)
        # written by the kernel when a wait times out: host memory, read without a GPU sync
        self._status = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._status_np = self._status.numpy()  # the same memory, read in ~100 ns
        self._closed = False
        self._broken: str | None = None

    # ---- the choice by size ----------------------------------------------------------
    def algorithm(self, nbytes: int, dtype: torch.dtype = torch.bfloat16) -> str:
        """"one_shot" | "two_shot" | "nccl" for a message of `nbytes` bytes."""
        return choose(nbytes, self.world, self.max_bytes, self.one_shot_max_bytes, dtype)

    # ---- the call --------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self._usable()
        if not isinstance(x, torch.Tensor) or x.device != self.device:
            raise ValueError(f"rank {self.rank}: expected a tensor on {self.device}, got "
                             f"{getattr(x, 'device', type(x).__name__)}")
        if out is None:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device \
                or not out.is_contiguous():
            raise ValueError(f"rank {self.rank}: out must be contiguous with x's shape "
                             f"{tuple(x.shape)}, dtype {x.dtype} and device; got "
                             f"{tuple(out.shape)} {out.dtype} {out.device}")
        nbytes = x.numel() * x.element_size()
        name = self.algorithm(nbytes, x.dtype)
        capturing = torch.cuda.is_current_stream_capturing()
        if self.debug and not capturing:
            self._agree(x, name)
        if name == "nccl" or x.numel() == 0:
            if out.data_ptr() != x.data_ptr():
                out.copy_(x)
            if x.numel():
                dist.all_reduce(out, group=self.group)
            return out
        self._launch(x.contiguous(), out, name)
        if self.debug and not capturing:
            self.check()
        return out

    # Kernel knobs (class defaults; set on an instance to measure the alternatives):
    # serial_barrier: thread 0 signals and waits for the peers in turn (the first version)
    # instead of one lane per peer; pull_gather: two-shot's second half reads the owners'
    # sums from their buffers (False: owners push them into every buffer, then a local copy).
    serial_barrier = False
    pull_gather = True
    # pdl: launch the one-shot kernels with programmatic dependent launch, as layer 1's decode
    # kernels are (see peer_kernels._pdl_start): the projection after an all-reduce launches
    # while it waits for the peers. low_latency: one-shot messages of at most LL_MAX_BYTES
    # (whole 16-byte vectors) go as NCCL-style LL packets, data and flag in one store, no
    # barrier (peer_kernels.py); read at construction (it sizes the buffers). Both on unless
    # LLM_STACK_PEER_PDL=0 / LLM_STACK_PEER_LL=0. Measured on 2x H200 (8B shape, TP=2): inside a
    # decoder layer's batch-1 GEMV chain each all-reduce costs 4.14 us over none as the barrier
    # one-shot, 3.84 with LL, 3.76 with PDL, 3.02 with both (benchmarks/tp_decode_chain.py);
    # the engine's batch-1 decode 2.606 -> 2.475 ms a step (384 -> 404 tok/s, 1.51x -> 1.58x
    # TP=1), batch 32 unchanged (9,497 / 9,515 tok/s).
    PDL_ENV = PDL_ENV
    pdl = kernels.env_switch(PDL_ENV, True)
    LL_ENV = LL_ENV
    low_latency = kernels.env_switch(LL_ENV, True)
    LL_MAX_BYTES = 64 << 10
    # each slot of the LL region (one rank's packets of a call). LL_MAX_BYTES needs 64 KiB;
    # the slot is larger because it was sized for an LL form of all_reduce_rms_norm (decode's
    # 32 rows of 4096 bf16: 256 KiB), since taken out: it cost 7.09 us against the barrier
    # kernel's 3.00 over no all-reduce in a TP=2 layer on 2x H200. Benchmarks raise
    # LL_MAX_BYTES up to it (tp_decode_chain.py's ll variants at batch 32).
    LL_SLOT_BYTES = 256 << 10

    def _pdl(self) -> dict:
        """Launch keywords for a one-shot kernel: PDL on Hopper and later when self.pdl."""
        on = self.pdl and torch.cuda.get_device_capability(self.device)[0] >= 9
        return {"PDL": True, "launch_pdl": True} if on else {}

    def block_elems(self, elsize: int) -> int:
        """Elements one block moves per pass: one 16-byte vector per thread (with more, the
        compiler interleaves the second vector's loads with the first's adds, and each
        waits for an NVLink round trip of its own)."""
        return self.num_warps * 32 * (16 // elsize)

    def active_blocks(self, name: str, numel: int, elsize: int) -> int:
        """How many of the grid's blocks work on a message of numel elements: one pass each
        up to the grid (a two-shot pass is a tile of W pieces)."""
        unit = self.block_elems(elsize) * (self.world if name == "two_shot" else 1)
        return max(1, min(self.blocks, -(-numel // unit)))

    def _takes_ll(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """Whether a one-shot call goes through the low-latency kernel (see low_latency)."""
        nbytes = x.numel() * x.element_size()
        return (nbytes <= min(self.LL_MAX_BYTES, self._ll_slot_words * 4) and nbytes % 16 == 0
                and (x.data_ptr() | out.data_ptr()) % 16 == 0)

    def _ll_blocks(self, nwords: int) -> tuple[int, int]:
        """(words a block takes a pass, blocks with words) of an LL call of nwords words: two
        8-byte packets a thread per pass."""
        block = self.num_warps * 32 * 2
        return block, max(1, min(self.blocks, -(-nwords // block)))

    def _launch_ll(self, x: torch.Tensor, out: torch.Tensor) -> None:
        from . import peer_kernels

        words, out_words = x.view(-1).view(torch.int32), out.view(-1).view(torch.int32)
        block, active = self._ll_blocks(words.numel())
        peer_kernels.one_shot_ll_kernel[(self.blocks,)](
            words, out_words, words.numel(), active, self._lls, self._state,
            self._status.data_ptr(), int(self.timeout_s * 1e9), self._ll_slot_words,
            RANK=self.rank, WORLD=self.world, BLOCK=block, KIND=_LL_KINDS[x.dtype],
            num_warps=self.num_warps, **self._pdl())

    def _launch(self, x: torch.Tensor, out: torch.Tensor, name: str, *segment: int) -> None:
        from . import peer_kernels

        if name == "one_shot" and self.low_latency and self._ll_slot_words and \
                self._takes_ll(x, out):
            return self._launch_ll(x, out)
        kernel = getattr(peer_kernels, f"{name}_kernel")
        elsize = x.element_size()
        extra = {"PULL": bool(self.pull_gather)} if name == "two_shot" else {}
        if name == "one_shot":
            extra.update(self._pdl())
        serial = bool(self.serial_barrier) or self.world > peer_kernels.PARALLEL_MAX_WORLD
        kernel[(self.blocks,)](
            x, out, x.numel(), self.active_blocks(name, x.numel(), elsize), *segment,
            self._buffers(x.dtype), self._pads, self._state,
            self._status.data_ptr(), int(self.timeout_s * 1e9), self.max_bytes // elsize,
            RANK=self.rank, WORLD=self.world, BLOCK=self.block_elems(elsize), SERIAL=serial,
            num_warps=self.num_warps, **extra)

    # ---- the GEMV that sends its outputs, then the receive -------------------------------
    # gemv_send: gemv_all_reduce runs as layer 2's gemv_send_kernel (the GEMV, its outputs sent
    # to the peers as LL packets from its epilogue) and ll_receive_kernel (poll and sum) instead
    # of layer 1's gemv and the LL one-shot: the send overlaps the GEMV's tail. On unless
    # LLM_STACK_TP_GEMV_SEND=0: on 4x H200 (8B shape) each TP=2 batch-1 all-reduce costs 2.61 us
    # over none in a decoder layer's GEMV chain against 3.04 for the LL+PDL one-shot
    # (benchmarks/tp_decode_chain.py), and the engine's batch-1 decode 406 -> 415 tok/s at TP=2,
    # 591 -> 617 at TP=4; batch 32 does not take it (9,145 / 9,698 tok/s, within the spread).
    GEMV_SEND_ENV = GEMV_SEND_ENV
    gemv_send = kernels.env_switch(GEMV_SEND_ENV, True)

    def sends_from_gemv(self, x: torch.Tensor, w: torch.Tensor, silu: bool = False) -> bool:
        """Whether gemv_all_reduce(x, w, silu) takes the fused path: gemv_send on, the LL region
        there, one fp16/bf16 row of x on this device, w (N, K) of x's dtype, contiguous rows,
        and N outputs within an LL slot and LL_MAX_BYTES."""
        if not (self.gemv_send and self._ll_slot_words and x.dim() == 2 and x.shape[0] == 1
                and w.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16)
                and w.dtype == x.dtype and x.device == self.device == w.device
                and x.stride(-1) == 1 and w.stride(-1) == 1):
            return False
        if x.shape[1] != (2 if silu else 1) * w.shape[1]:
            return False
        nbytes = 4 * (-(-w.shape[0] // 2))  # whole words
        return 0 < nbytes <= min(self.LL_MAX_BYTES, self._ll_slot_words * 4)

    def gemv_all_reduce(self, x: torch.Tensor, w: torch.Tensor, silu: bool = False
                        ) -> torch.Tensor:
        """The sum over ranks of a @ w^T, a = x (1, K), or silu(gate) * up of x = [gate | up]
        (1, 2K) (silu=True): what self(layer 1's gemv(x, w)) (gemv_silu_mul) returns, to the
        bit. A row-parallel projection and its all-reduce (tensor-parallel decode at batch 1).
        Where sends_from_gemv: the GEMV sends its outputs to the peers from its epilogue and a
        second kernel polls and sums (gemv_send.py); elsewhere those two calls. Collective,
        like a call: every rank passes the same shapes."""
        if not self.sends_from_gemv(x, w, silu):
            return self(kernels.gemv_silu_mul(x, w) if silu else kernels.gemv(x, w))
        self._usable()
        capturing = torch.cuda.is_current_stream_capturing()
        if self.debug and not capturing:
            self._agree(x, "gemv_send")
        from . import gemv_send, peer_kernels

        parts = kernels.GEMV_PARTS
        N, K = w.shape
        nwords = -(-N // 2)
        block_n, block_k, warps, stages = parts.unpack(parts.config_for(N, K, 1))
        block_n = max(2, block_n)  # whole words per program
        y = torch.empty((1, 2 * nwords), dtype=x.dtype, device=x.device)
        out = torch.empty_like(y)
        pdl = parts.pdl_launch(x.device)
        gemv_send.gemv_send_kernel[(-(-N // block_n),)](
            x, w, y, N, w.stride(0), self._lls, self._state, self._ll_slot_words,
            K=K, PROLOGUE=parts.SILU if silu else parts.NONE, BLOCK_N=block_n, BLOCK_K=block_k,
            EVEN_K=K % block_k == 0, STAGES=stages, RANK=self.rank, WORLD=self.world,
            PDL_EARLY=parts.pdl_early(), num_warps=warps, **pdl)
        block, active = self._ll_blocks(nwords)
        peer_kernels.ll_receive_kernel[(self.blocks,)](
            y.view(torch.int32), out.view(torch.int32), nwords, active, self._lls, self._state,
            self._status.data_ptr(), int(self.timeout_s * 1e9), self._ll_slot_words,
            RANK=self.rank, WORLD=self.world, BLOCK=block, KIND=_LL_KINDS[x.dtype],
            num_warps=self.num_warps, **self._pdl())
        if self.debug and not capturing:
            self.check()
        return out[:, :N]

    # ---- the all-reduce with the residual add and RMSNorm after it ----------------------
    #: Widest row the fused kernel takes (a row in one block's registers, as layer 1's norm).
    NORM_MAX_COLS = 16384

    def fuses_norm(self, x: torch.Tensor) -> bool:
        """Whether all_reduce_rms_norm(x, ...) runs as one kernel: a 2-D CUDA x in FLOATS,
        rows of at most NORM_MAX_COLS, small enough for the one-shot path."""
        return (x.dim() == 2 and x.is_cuda and 0 < x.shape[1] <= self.NORM_MAX_COLS
                and x.shape[0] > 0 and self.algorithm(x.numel() * x.element_size(), x.dtype)
                == "one_shot")

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, h) with h = (sum over ranks of x) + residual and y = rms_norm(h) * weight: what
        self(x) followed by layer 1's rms_norm(s, weight, eps=eps, residual=residual) returns,
        in one kernel (fuses_norm) or else as those two calls. The step of a tensor-parallel
        block after each row-parallel projection: its partial sums joined, added to the
        residual stream, normalised for the next projection. x, residual: (rows, H), same
        dtype; weight (H,). Collective, like a call."""
        if residual.shape != x.shape or residual.dtype != x.dtype or weight.shape != x.shape[-1:]:
            raise ValueError(f"rank {self.rank}: all_reduce_rms_norm needs residual of x's shape "
                             f"{tuple(x.shape)} and dtype {x.dtype} and a ({x.shape[-1]},) weight; "
                             f"got {tuple(residual.shape)} {residual.dtype} and "
                             f"{tuple(weight.shape)}")
        if not self.fuses_norm(x):
            return kernels.rms_norm(self(x), weight, eps=eps, residual=residual)
        self._usable()
        if x.device != self.device:
            raise ValueError(f"rank {self.rank}: expected a tensor on {self.device}, "
                             f"got {x.device}")
        capturing = torch.cuda.is_current_stream_capturing()
        if self.debug and not capturing:
            self._agree(x, "one_shot_norm")
        from . import peer_kernels

        x, residual, weight = x.contiguous(), residual.contiguous(), weight.contiguous()
        y, h = torch.empty_like(x), torch.empty_like(x)
        rows, H = x.shape
        serial = bool(self.serial_barrier) or self.world > peer_kernels.PARALLEL_MAX_WORLD
        block_h = 1 << (H - 1).bit_length()
        peer_kernels.one_shot_norm_kernel[(self.blocks,)](
            x, residual, weight, y, h, rows, H, float(eps), min(self.blocks, rows),
            self._buffers(x.dtype), self._pads, self._state, self._status.data_ptr(),
            int(self.timeout_s * 1e9), self.max_bytes // x.element_size(),
            RANK=self.rank, WORLD=self.world, BLOCK_H=block_h, SERIAL=serial,
            num_warps=max(1, min(self.num_warps, block_h * x.element_size() // (16 * 32))),
            **self._pdl())
        if self.debug and not capturing:
            self.check()
        return y, h

    # ---- all-gather and reduce-scatter through the same buffers ------------------------
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x (same shape everywhere) concatenated in rank order along dim 0
        (a 0-d x gives shape (W,)): one barrier, each rank reads (W-1) x n from its peers.
        Above max_bytes per rank, or for other dtypes, NCCL's all_gather_into_tensor."""
        flat = self._check_input(x, "all_gather")
        out = flat.new_empty(self.world * flat.numel())
        if flat.numel() * flat.element_size() > self.max_bytes or flat.dtype not in FLOATS:
            dist.all_gather_into_tensor(out, flat, group=self.group)
        elif flat.numel():
            self._launch(flat, out, "all_gather")
            self._after()
        shape = (self.world * x.shape[0], *x.shape[1:]) if x.dim() else (self.world,)
        return out.view(shape)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's segment of the sum over ranks, 1-D: segment r of
        torch.tensor_split(x.flatten(), W) (any size). One barrier; each rank reads
        (W-1)/W x n from its peers. Above max_bytes: NCCL's reduce_scatter_tensor (which
        needs n divisible by W)."""
        flat = self._check_input(x, "reduce_scatter")
        n = flat.numel()
        lo = (n // self.world) * self.rank + min(self.rank, n % self.world)
        hi = lo + n // self.world + (1 if self.rank < n % self.world else 0)
        out = flat.new_empty(hi - lo)
        if n * flat.element_size() > self.max_bytes or flat.dtype not in FLOATS:
            if n % self.world:
                raise ValueError(f"rank {self.rank}: reduce_scatter of {n} elements is larger than "
                                 f"the registered {self.max_bytes} bytes and NCCL needs a multiple "
                                 f"of {self.world} elements; construct with a larger max_bytes")
            dist.reduce_scatter_tensor(out, flat, group=self.group)
        elif n:
            self._launch(flat, out, "reduce_scatter", lo, hi)
            self._after()
        return out

    def _check_input(self, x: torch.Tensor, what: str) -> torch.Tensor:
        self._usable()
        if not isinstance(x, torch.Tensor) or x.device != self.device:
            raise ValueError(f"rank {self.rank}: {what} expects a tensor on {self.device}, got "
                             f"{getattr(x, 'device', type(x).__name__)}")
        if self.debug and not torch.cuda.is_current_stream_capturing():
            self._agree(x, what)
        return x.contiguous().view(-1)

    def _after(self) -> None:
        if self.debug and not torch.cuda.is_current_stream_capturing():
            self.check()

    def _buffers(self, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Every rank's buffer (both halves) as `dtype`, mapped here: views made once."""
        if dtype not in self._views:
            n = 2 * self.max_bytes // torch.empty(0, dtype=dtype).element_size()
            self._views[dtype] = tuple(self._handle.get_buffer(r, (n,), dtype)
                                       for r in range(self.world))
        return self._views[dtype]

    # ---- errors ------------------------------------------------------------------------
    def check(self) -> None:
        """Wait for the GPU, then raise if any call so far timed out waiting for a peer."""
        torch.cuda.current_stream(self.device).synchronize()
        self._usable()

    def _usable(self) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: this PeerAllReduce was closed")
        code = int(self._status_np[0])  # host memory: no GPU sync
        if code and self._broken is None:
            self._broken = (f"rank {self.rank}: peer all-reduce timed out after "
                            f"{self.timeout_s:g} s waiting for rank {code - 1} (it never "
                            "arrived: it died, hangs, or called a different collective); "
                            "results since then are invalid and this PeerAllReduce cannot be "
                            "used again")
        if self._broken:
            raise RuntimeError(self._broken)

    def _agree(self, x: torch.Tensor, name: str) -> None:
        """debug=True: swap (numel, dtype, algorithm) with every rank; raise on a mismatch."""
        mine = (x.numel(), str(x.dtype), name)
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        bad = [r for r, theirs in enumerate(everyone) if theirs != mine]
        if bad:
            others = "; ".join(f"rank {r} passed {everyone[r][0]} x {everyone[r][1]}"
                               for r in bad)
            raise ValueError(f"rank {self.rank}: peer all-reduce of {mine[0]} x {mine[1]} "
                             f"({name}), but " + others
                             + ": every rank must all-reduce the same size and dtype")

    def close(self) -> None:
        """Release the buffers (collective in spirit: every rank closes its own)."""
        if not self._closed:
            self._closed = True
            self._views.clear()
            self._pads, self._lls = (), ()
            self._handle = None
            self._storage = None
            from .symmetric_group import release

            release(self._symmetric)

    def __repr__(self) -> str:
        return (f"PeerAllReduce(rank={self.rank}, world={self.world}, max_bytes={self.max_bytes}, "
                f"one_shot_max_bytes={self.one_shot_max_bytes}, blocks={self.blocks})")
