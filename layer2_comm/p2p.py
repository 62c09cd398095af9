"""Point-to-point plumbing that every collective here is built from.

- `segment_bounds(n, parts)`: how an n-element tensor is cut into `parts` contiguous
  segments for any n (the first n % parts segments get one element more, as
  `torch.tensor_split` and `np.array_split` cut them).
- `reduce_into(out, a, b, op)`: out = a (+ or max) b, for float and integer dtypes.
- `exchange(sends, recvs)`: post sends and receives together with `batch_isend_irecv`
  (a ring step sends to one neighbour while receiving from the other; two blocking
  `send`s facing each other could wait forever; NCCL runs one batch as one group, in one
  kernel) and return a handle whose `wait()` has a timeout and says which peers did not
  answer. A message of at least `stripe_min_bytes` is split over `lanes` process groups
  (tuning.py): each part is its own message on its own communicator, and both sides cut it
  the same way because both know its size.
- `agree(...)`: before any data moves, each rank swaps a seven-number header (collective,
  numel, dtype, op, lanes, two parameters such as pieces or src) with the ranks it will talk
  to. Gloo happily receives 10 elements into an 11-element buffer and corrupts the result,
  and NCCL waits forever for the missing element, so a mismatch is caught here and raises
  ValueError on both sides of every disagreeing pair. The headers are CPU tensors on a gloo
  group (`group.control_group()`): comparing them never waits for the GPU, which keeps
  working through whatever was queued before. It costs one host round trip per collective,
  not one per message; `tuning.override(check=False)` skips it.

On NCCL nothing here waits for the GPU on the host: `Pending.wait()` only makes the
current CUDA stream wait for the communicators' streams, so the host runs ahead and queues
the whole collective while the GPU works.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from . import group, tuning

OPS = ("sum", "max", "avg")
KINDS = ("ring_all_reduce", "tree_all_reduce", "ring_all_gather", "ring_reduce_scatter",
         "broadcast_tree", "broadcast_chain", "all_to_all", "hierarchical_all_reduce")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
HEADER_PARAMS = 2  # named integer parameters a header carries (pieces, src, ...)
HEADER_SIZE = 5 + HEADER_PARAMS  # kind, numel, dtype, op, lanes, then the parameters
HEADER_TAG = 1 << 20  # keeps headers apart from data messages (tags 0, 1, 2, ...) on gloo


def segment_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """[(start, stop)] of `parts` contiguous segments covering range(n); sizes differ by <= 1."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def check_op(op: str, dtype: torch.dtype) -> None:
    """Reject unknown ops, and avg on integers (whose rounding the caller should choose)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if op == "avg" and not dtype.is_floating_point:
        raise ValueError(f"op='avg' needs a floating-point tensor, got {dtype}; "
                         "use op='sum' and divide, choosing how to round")


def reduce_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: str) -> None:
    """out = a op b elementwise ("avg" adds here; the caller divides once at the end)."""
    if op == "max":
        torch.maximum(a, b, out=out)
    else:
        torch.add(a, b, out=out)


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous view of `tensor` (a copy if it is not contiguous: see write_back)."""
    return tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def write_back(tensor: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """Copy a flat work buffer into `tensor` when `flat` had to copy; returns `tensor`."""
    if not tensor.is_contiguous():
        tensor.copy_(work.view(tensor.shape))
    return tensor


class Pending:
    """Posted sends/receives; `wait()` finishes them all or raises within the timeout."""

    def __init__(self, works: list, peers: set[int], what: str, nccl: bool) -> None:
        self.works, self.peers, self.what, self.nccl = works, peers, what, nccl

    def wait(self) -> None:
        limit = group.timeout_s()
        for work in self.works:
            try:
                if self.nccl:  # the NCCL watchdog enforces the timeout; wait() only orders streams
                    work.wait()
                else:
                    work.wait(timeout=timedelta(seconds=limit))
            except Exception as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise RuntimeError(
                    f"rank {group.rank()}: {self.what}: a transfer with rank(s) "
                    f"{sorted(self.peers)} "
                    f"failed or timed out (waits are limited to {limit:g} s): a peer died, raised, "
                    f"or called a different collective. Backend said: {first}") from exc
        self.works = []


def stripe(tensor: torch.Tensor, lanes: int, min_bytes: int) -> list[torch.Tensor]:
    """One message's parts, one per lane: slices of the flat tensor cut like segment_bounds.

    Below ``min_bytes``, or with one lane, the whole message goes on lane 0. Parts may be
    empty (fewer elements than lanes); `exchange` skips those on both sides.
    """
    if lanes == 1 or tensor.numel() * tensor.element_size() < min_bytes:
        return [tensor]
    whole = tensor.view(-1)  # messages are contiguous slices: a view, never a copy
    return [whole[a:b] for a, b in segment_bounds(whole.numel(), lanes)]


def exchange(sends: Iterable[tuple], recvs: Iterable[tuple], *, tag: int = 0,
             what: str = "transfer") -> Pending:
    """Post every send (tensor, dst[, tag]) and receive (buffer, src[, tag]) at once.

    Empty tensors are skipped: both sides know every size (after `agree`), so both skip the
    same messages. Tags default to `tag`; on gloo a receive matches only a send with its tag.
    Each lane's messages go in one `batch_isend_irecv` (one NCCL group call, one kernel).
    """
    t = tuning.current()
    lanes = group.lane_groups(t.lanes)
    batches: list[list] = [[] for _ in lanes]
    peers = set()
    for op, messages in ((dist.isend, sends), (dist.irecv, recvs)):
        for message in messages:
            tensor, peer = message[0], message[1]
            if not tensor.numel():
                continue
            peers.add(peer)
            label = message[2] if len(message) > 2 else tag
            for lane, part in enumerate(stripe(tensor, len(lanes), t.stripe_min_bytes)):
                if part.numel():
                    batches[lane].append(dist.P2POp(op, part, peer, group=lanes[lane], tag=label))
    works = []
    for batch in batches:
        if batch:
            works += dist.batch_isend_irecv(batch)
    return Pending(works, peers, what, nccl=group.backend() == "nccl")


def exchange_headers(headers: dict[int, Sequence[int]], what: str) -> dict[int, list[int]]:
    """Send headers[peer] to each peer and return what each peer sent back to us.

    CPU tensors on the control group (gloo): no GPU work, no GPU wait.
    """
    control = group.control_group()
    # One length for every header, so that even two different collectives meeting by
    # mistake exchange well-formed headers (and the kind field tells them apart).
    mine = {p: torch.tensor((list(h) + [0] * HEADER_SIZE)[:HEADER_SIZE], dtype=torch.int64)
            for p, h in headers.items()}
    theirs = {p: torch.empty_like(t) for p, t in mine.items()}
    ops = [dist.P2POp(dist.isend, t, p, group=control, tag=HEADER_TAG) for p, t in mine.items()]
    ops += [dist.P2POp(dist.irecv, t, p, group=control, tag=HEADER_TAG) for p, t in theirs.items()]
    works = dist.batch_isend_irecv(ops) if ops else []
    Pending(list(works), set(headers), f"{what} (header)", nccl=False).wait()
    return {p: t.tolist() for p, t in theirs.items()}


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES)


def check_device(kind: str, tensor: torch.Tensor) -> None:
    """The backend moves tensors of one device type: CUDA for NCCL, CPU for gloo."""
    want = group.device().type
    if tensor.device.type != want:
        raise ValueError(f"{kind}: the tensor is on {tensor.device} but the {group.backend()} "
                         f"backend moves {want} tensors")


def describe(header: Sequence[int], names: Sequence[str] = ()) -> str:
    """Turn a header back into words for an error message."""
    kind, numel, dtype, op, lanes, *values = header
    name = KINDS[kind] if 0 <= kind < len(KINDS) else f"collective #{kind}"
    dt = str(DTYPES[dtype]) if 0 <= dtype < len(DTYPES) else "an unsupported dtype"
    text = f"{name}({numel} elements of {dt}"
    if 0 <= op < len(OPS):
        text += f", op={OPS[op]!r}"
    for key, value in zip(names, values, strict=False):
        text += f", {key}={value}"
    return text + (f", lanes={lanes}" if lanes != 1 else "") + ")"


def agree(kind: str, tensor: torch.Tensor, peers: Iterable[int], *, op: str | None = None,
          params: Sequence[tuple[str, int]] = ()) -> None:
    """Check, with each peer, that both called `kind` on the same numel/dtype/op/params.

    `peers` must be symmetric (if I list you, you list me). Raises ValueError naming both
    ranks and what each passed; the peer raises the mirror-image error at the same time.
    Also checks that the tensor lives where the backend can move it, and makes the lane
    groups (on first use), here where every rank passes at the same point.
    """
    check_device(kind, tensor)
    if len(params) > HEADER_PARAMS:
        raise ValueError(f"a header carries at most {HEADER_PARAMS} parameters")
    me = group.rank()
    peers = sorted({p for p in peers if p != me})
    if not peers:
        return
    t = tuning.current()
    if t.check:
        values = [int(v) for _, v in params] + [0] * (HEADER_PARAMS - len(params))
        header = [KINDS.index(kind), tensor.numel(), dtype_code(tensor.dtype),
                  OPS.index(op) if op is not None else -1, t.lanes, *values]
        theirs = exchange_headers({p: header for p in peers}, what=kind)
        names = [k for k, _ in params]
        for peer in peers:
            if theirs[peer] != header:
                raise ValueError(
                    f"rank {me} called {describe(header, names)} but rank {peer} called "
                    f"{describe(theirs[peer], names)}: every rank must pass the same number of "
                    "elements, dtype and arguments (and use the same layer-2 tuning)")
    group.lane_groups(t.lanes)


def ring_neighbours(ranks: Sequence[int], me: int) -> tuple[int, int]:
    """(previous, next) of `me` on the ring that visits `ranks` in order."""
    i = ranks.index(me)
    return ranks[(i - 1) % len(ranks)], ranks[(i + 1) % len(ranks)]
