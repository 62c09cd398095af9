"""Row-wise argmax of a few long rows (greedy decoding's pick over the vocabulary) in one launch.

    argmax(x (M, N)) -> (M,) int64      what torch.argmax(x, -1) returns: the first index of
                                         the row's maximum; a NaN beats every value (+inf
                                         too): the first NaN's index

Why a kernel of its own. torch reduces a (1, 128256) row with a single thread block: ~32 us
on an H100, 3% of a batch-1 decode step of a 1B model. Here each row is cut into
BLOCK-wide pieces, one program each (32 programs for 128256), every program writes its
piece's (max, first index) and takes a ticket (an atomic counter); the last one in reduces
the partials, in piece order, so the result is deterministic, and resets the counter for
the next call. Two round trips to L2 instead of one program walking the whole row.
"""
from __future__ import annotations

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET)

# isort: split
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .gemv import pdl_launch
from .host import cdiv, next_pow2
from .paged_decode import _hooked, _stream_getter

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_WORK: dict[torch.device, torch.Tensor] = {}  # the pieces' partial results, kept per device
_RETIRED: list[torch.Tensor] = []  # outgrown buffers: graphs captured earlier still use them
#: (device, dtype, N, row stride, block, pieces, PDL) -> the compiled kernel that served it,
#: launched directly on the next call of that shape (no JIT binding): an eager greedy step's
#: argmax is launched from the host (a graph-replayed decode step has it inside its graph).
_LAUNCHES: dict[tuple, object] = {}


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, part_v_ptr, part_i_ptr, count_ptr, N, stride_xm, n_pieces,
                   BLOCK: tl.constexpr, PIECES: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    if PDL:  # the logits come from the kernel before
        gdc_wait()
        gdc_launch_dependents()
    offs = piece * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=float("-inf")).to(tl.float32)
    nan = ok & (x != x)
    first_nan = tl.min(tl.where(nan, offs, N), 0)  # torch: a NaN beats everything, even +inf
    x = tl.where(ok & (x == x), x, float("-inf"))
    m = tl.max(x, 0)
    idx = tl.min(tl.where(ok & (x == m), offs, N), 0)  # the first index of the piece's max
    has_nan = first_nan < N
    slot = row * n_pieces + piece
    tl.store(part_v_ptr + slot, tl.where(has_nan, float("nan"), m))
    tl.store(part_i_ptr + slot, tl.where(has_nan, first_nan, idx))
    tl.debug_barrier()  # the partial's stores precede the ticket (release)
    ticket = tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu")
    if ticket == n_pieces - 1:  # the last piece in: reduce the partials, in piece order
        p = tl.arange(0, PIECES)
        p_ok = p < n_pieces
        v = tl.load(part_v_ptr + row * n_pieces + p, mask=p_ok, other=float("-inf"),
                    cache_modifier=".cg")
        i = tl.load(part_i_ptr + row * n_pieces + p, mask=p_ok, other=N, cache_modifier=".cg")
        v_nan = p_ok & (v != v)
        nan_at = tl.min(tl.where(v_nan, i, N), 0)  # pieces in order: the first NaN of the row
        v = tl.where(v_nan, float("-inf"), v)
        best = tl.max(v, 0)
        at = tl.min(tl.where(p_ok & (v == best), i, N), 0)
        tl.store(out_ptr + row, tl.where(nan_at < N, nan_at, at).to(tl.int64))
        tl.atomic_xchg(count_ptr + row, 0, sem="relaxed", scope="gpu")  # ready for the next call


def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.argmax(x, dim=-1)


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """n int32 zeros that every launch leaves at zero (kept per device; a graph being
    captured that needs more gets zeros of its own, reset by the kernel like these)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing:
            return torch.zeros(n, dtype=torch.int32, device=device)
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 64), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def _work(device: torch.device, n: int) -> torch.Tensor:
    """Room for n partial results (n fp32 maxima, then n int32 indices), kept per device; a
    graph being captured that needs more gets its own."""
    buf = _WORK.get(device)
    if buf is None or buf.numel() < 2 * n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.empty(2 * n, dtype=torch.float32, device=device)
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.empty(max(2 * n, 4096), dtype=torch.float32, device=device)
        _WORK[device] = buf
    return buf


def argmax(x: torch.Tensor, *, impl: str = "auto", block: int = 4096,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, N) fp16/bf16/fp32 -> (M,) int64: the first index of each row's maximum. out: an
    (M,) int64 tensor on x's device to write them into (e.g. a CUDA graph's static buffer)."""
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax: x must be (M, N) with N >= 1, got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x.stride(-1) != 1:
        raise ValueError(f"argmax: x must be fp16/bf16/fp32 with a contiguous last dim, got "
                         f"{x.dtype} strides {x.stride()}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"argmax: block must be a power of two >= 16, got {block}")
    M, N = x.shape
    if out is not None and (out.shape != (M,) or out.dtype != torch.int64
                            or out.device != x.device or not out.is_contiguous()):
        raise ValueError(f"argmax: out must be a contiguous ({M},) int64 tensor on {x.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    if not interpreter.use_triton(impl, x, "argmax"):
        return argmax_reference(x) if out is None else torch.argmax(x, dim=-1, out=out)
    if out is None:
        out = torch.empty(M, dtype=torch.int64, device=x.device)
    if M == 0:
        return out
    block = min(block, max(16, next_pow2(N)))
    pieces = cdiv(N, block)
    work = _work(x.device, M * pieces)
    part_v, part_i = work[:M * pieces], work[M * pieces:2 * M * pieces].view(torch.int32)
    pdl = pdl_launch(x.device)
    args = (x, out, part_v, part_i, _counters(x.device, M), N, x.stride(0), pieces,
            block, max(2, next_pow2(pieces)), pdl["PDL"])
    key = None
    if (not interpreter.INTERPRETED and x.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0
            and part_i.data_ptr() % 16 == 0):
        key = (x.device, x.dtype, N, x.stride(0), block, pieces, pdl["PDL"])
    kernel = _LAUNCHES.get(key) if key is not None and not _hooked() else None
    if kernel is not None:
        get_stream, get_device = _stream_getter()
        try:  # the launcher parses its arguments before launching: a failure launched nothing
            kernel.run(M, pieces, 1, get_stream(get_device()), kernel.function,
                       kernel.packed_metadata, None, None, None, *args)
            return out
        except (TypeError, ValueError, SystemError):  # a Triton whose launcher differs
            _LAUNCHES.clear()
            key = None
    kernel = _argmax_kernel[(M, pieces)](
        *args[:8], BLOCK=block, PIECES=args[9],
        num_warps=1 if interpreter.INTERPRETED else 4, **pdl,
    )
    if key is not None and kernel is not None and hasattr(kernel, "packed_metadata"):
        _LAUNCHES[key] = kernel
    return out
