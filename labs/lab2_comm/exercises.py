"""Lab 2 — communication: your answers.

Four exercises, in the order `lab2.ipynb` teaches them:

1. `ring_all_reduce` — all-reduce as a ring: a reduce-scatter, then an all-gather, built from
   nothing but point-to-point messages.
2. `ring_all_gather` — the all-gather on its own, returning a new tensor.
3. The alpha-beta cost model — `busbw`, `predict`, `crossover` and `fit_alpha_beta`.
4. `one_shot_all_reduce` and `two_shot_all_reduce` — the all-reduces GPUs joined by NVLink
   use for small messages, where every rank can load and store into every other rank's
   memory. Here the ranks are simulated in one process (see Exercise 4 below).

Write the code where it says YOUR CODE (each function raises NotImplementedError until you
do). Grade yourself with `stack grade --lab 2`.

How your collectives run: every rank is its own process running the same code, and your
function is called on all of them at once, each with its own tensor. `dist.get_rank()` says
which rank this is and `dist.get_world_size()` how many there are (p). The notebook and the
grader start p ranks on this CPU with `layer2_comm.launch`, talking gloo over 127.0.0.1; the
same code runs on GPUs with NCCL.

Rules the grader enforces (see tests/labs/test_lab2.py):
* Point-to-point messages only: `dist.send`, `dist.recv`, `dist.isend`, `dist.irecv`,
  `dist.batch_isend_irecv` (with `dist.P2POp`). While your function runs, torch.distributed's
  collectives (all_reduce, all_gather, reduce_scatter, broadcast, barrier, ...) raise.
* It must be a ring: rank r sends only to its right-hand neighbour (r + 1) % p, and only as
  many bytes as the ring needs. The grader counts what each rank sends, to whom.
* A deadlock costs points, not the grading run: ranks that have not finished after 20 s are
  stopped and the test fails.
* Do not import `layer2_comm` here: it holds the answers, and the grader refuses it.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np  # noqa: F401 (for fit_alpha_beta: np.linalg.lstsq)
import torch
import torch.distributed as dist


# ---- plumbing (read, no need to edit) ------------------------------------------------
def ring_position() -> tuple[int, int, int, int]:
    """(rank, p, left, right): this rank, the number of ranks, and its neighbours on the
    ring 0 -> 1 -> ... -> p-1 -> 0 (it receives from left and sends to right)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    return rank, p, (rank - 1) % p, (rank + 1) % p


def segment_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """[(start, stop)] of `parts` contiguous segments covering range(n), for any n: the first
    n % parts segments get one element more (as torch.tensor_split cuts). With n < parts some
    segments are empty — a message of 0 elements is fine with gloo."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class AlphaBeta:
    """One link: `alpha_s` seconds of latency per message, `beta_s_per_byte` seconds per byte.

    (layer2_comm's is a frozen dataclass; this plain class behaves the same for this lab.)
    """

    __slots__ = ("alpha_s", "beta_s_per_byte")

    def __init__(self, alpha_s: float, beta_s_per_byte: float) -> None:
        if not (alpha_s >= 0 and beta_s_per_byte >= 0):
            raise ValueError(f"alpha and beta must be >= 0, got {alpha_s}, {beta_s_per_byte}")
        self.alpha_s, self.beta_s_per_byte = float(alpha_s), float(beta_s_per_byte)

    @classmethod
    def from_link(cls, latency_us: float, bandwidth_gb_s: float) -> AlphaBeta:
        """From a datasheet: latency in microseconds, bandwidth in GB/s (1e9 bytes/s)."""
        if bandwidth_gb_s <= 0:
            raise ValueError(f"bandwidth must be > 0 GB/s, got {bandwidth_gb_s}")
        return cls(latency_us * 1e-6, 1.0 / (bandwidth_gb_s * 1e9))

    @property
    def bandwidth(self) -> float:
        """Bytes per second (inf when beta is 0)."""
        return math.inf if self.beta_s_per_byte == 0 else 1.0 / self.beta_s_per_byte

    def message(self, nbytes: float) -> float:
        """Seconds to send one message of `nbytes` over this link: alpha + beta * nbytes."""
        return self.alpha_s + self.beta_s_per_byte * nbytes

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, AlphaBeta) and self.alpha_s == other.alpha_s
                and self.beta_s_per_byte == other.beta_s_per_byte)

    def __hash__(self) -> int:
        return hash((self.alpha_s, self.beta_s_per_byte))

    def __repr__(self) -> str:
        return f"AlphaBeta(alpha_s={self.alpha_s!r}, beta_s_per_byte={self.beta_s_per_byte!r})"


# ---- Exercise 1: ring all-reduce -----------------------------------------------------
def ring_all_reduce(tensor: torch.Tensor, op: str = "sum", *, chunks: int = 1) -> torch.Tensor:
    """Reduce `tensor` across all ranks with the ring algorithm, in place; return `tensor`.

    tensor: contiguous, any shape and any number of elements n (0, 1, fewer than p, not a
            multiple of p), float or integer dtype; the same shape and dtype on every rank.
    op:     "sum" or "max" (the lab asks for these two; raise ValueError for anything else).
    chunks: pipelining depth in layer2_comm's version; this lab asks only for chunks=1.

    Afterwards every rank's tensor holds the elementwise sum (or max) over all ranks, with
    bit-identical values on every rank. With `rank, p, left, right = ring_position()`, work
    on a flat view (`tensor.view(-1)`) cut into p segments by `segment_bounds(n, p)`:

    1. Reduce-scatter, p - 1 steps. At step k = 0 .. p-2, send segment (rank - k - 1) % p to
       the right, receive segment (rank - k - 2) % p from the left into a scratch buffer, and
       combine it into your copy of that segment (+ or torch.maximum). Each segment travels
       around the ring picking up one contribution per hop: afterwards this rank holds
       segment `rank` reduced over all ranks (the others hold partial results).
    2. All-gather, p - 1 steps. At step k, send segment (rank - k) % p to the right and
       receive segment (rank - k - 1) % p from the left, straight into place.

    Each rank sends 2(p-1) segments, 2(p-1)/p of the tensor, all to the right: the grader
    counts. A segment is reduced on one rank only and then copied, which is why every rank
    ends with the same bits.

    Deadlock: `dist.send` blocks until the receiver takes the message, so if every rank calls
    send before recv, all of them wait forever. Post each step's send and receive together:
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, right),
                                       dist.P2POp(dist.irecv, incoming, left)])
        for req in reqs:
            req.wait()
    Slices of a contiguous 1-D tensor (x[a:b]) can be sent from and received into directly.
    Don't change a buffer that is being sent before its request has completed.
    Tip: write the two phases as helpers; exercise 2 is the second one again.
    """
    # YOUR CODE
    raise NotImplementedError("ring_all_reduce")


# ---- Exercise 2: ring all-gather -----------------------------------------------------
def ring_all_gather(tensor: torch.Tensor, *, chunks: int = 1) -> torch.Tensor:
    """Every rank's `tensor` concatenated in rank order along dim 0: a new tensor; the input
    is left unchanged.

    tensor: contiguous, shape (n, ...) with n >= 0, any dtype; the same shape on every rank.
    chunks: pipelining depth in layer2_comm's version; this lab asks only for chunks=1.
    Returns shape (p * n, ...), whose rows r * n .. (r + 1) * n - 1 are rank r's tensor.

    The ring: allocate the output, copy your own tensor into piece `rank` of it, then for
    k = 0 .. p-2 send piece (rank - k) % p to the right and receive piece (rank - k - 1) % p
    from the left into its place. Each rank sends p - 1 pieces, (p-1)/p of the output, all to
    its right-hand neighbour.
    """
    # YOUR CODE
    raise NotImplementedError("ring_all_gather")


# ---- Exercise 3: the alpha-beta cost model --------------------------------------------
def busbw(algbw: float, collective: str, world: int) -> float:
    """nccl-tests' bus bandwidth (bytes/s): `algbw` (bytes / time) x the collective's factor,
    the share of the message each link must carry:

        all_reduce                              2(p-1)/p
        all_gather, reduce_scatter, all_to_all  (p-1)/p
        broadcast                               1

    collective: one of those five names, or an algorithm whose name contains one
    ("ring_all_reduce" and "tree_all_reduce" are all_reduce). p = world. Raise ValueError for
    any other name, or world < 1.
    """
    # YOUR CODE
    raise NotImplementedError("busbw")


def predict(algorithm: str, nbytes: float, world: int, ab: AlphaBeta, *, chunks: int = 4,
            ranks_per_node: int | None = None, inter: AlphaBeta | None = None) -> float:
    """Predicted seconds for `algorithm` on a message of `nbytes` (m) over `world` (p) ranks
    linked by `ab` (alpha, beta):

        ring_all_reduce       2(p-1) alpha + 2(p-1)/p m beta
        tree_all_reduce       s (alpha + m beta), s = log2 p if p is a power of two, else
                              floor(log2 p) + 2 (the extra ranks fold in first, get the
                              result last)
        ring_all_gather       (p-1) (alpha + m/p beta)    m = the gathered output
        ring_reduce_scatter   (p-1) (alpha + m/p beta)    m = the full input
        broadcast_tree        ceil(log2 p) (alpha + m beta)

    With one rank nothing moves: 0. Raise ValueError for any other algorithm, a world that is
    not a positive int, or nbytes < 0. `chunks`, `ranks_per_node` and `inter` belong to
    algorithms this lab does not ask for (broadcast_chain, hierarchical_all_reduce): ignore them.
    """
    # YOUR CODE
    raise NotImplementedError("predict")


def crossover(alg_a: str, alg_b: str, world: int, ab: AlphaBeta, **kw) -> float | None:
    """The message size in bytes where `alg_a` and `alg_b` take equally long (per `predict`,
    which gets `**kw`); None if they never do: parallel lines (equal slopes, by
    math.isclose(..., rel_tol=1e-9)) or lines that cross at m <= 0.

    Every prediction is a line in m: t = intercept + slope * m. Below the crossover the
    algorithm with the smaller intercept (latency) wins, above it the one with the smaller
    slope (bandwidth). E.g. ring vs tree all-reduce on 4 ranks: 6 alpha + 1.5 m beta equals
    2 alpha + 2 m beta at m = 8 alpha / beta.
    Careful: predict(..., 1) - predict(..., 0) loses the slope to rounding (beta ~ 1e-11
    next to alpha ~ 1e-5); measure the slope over a large span, such as 1e12 bytes.
    """
    # YOUR CODE
    raise NotImplementedError("crossover")


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float], *,
                   relative: bool = True) -> AlphaBeta:
    """Least-squares fit of t = alpha + beta * n to one-way point-to-point times (a ping-pong).

    The sizes span bytes to megabytes, so plain least squares would let the large messages'
    errors drown the small ones that carry alpha. With relative=True minimise the *relative*
    error instead, sum(((alpha + beta n - t) / t)^2): divide each row of the system
    [1, n] @ [alpha, beta] = t by its t, then np.linalg.lstsq. relative=False: plain.
    If the fit gives beta < 0 (time does not grow with size), return beta = 0 and alpha = the
    best constant (a weighted mean of the times); if it gives alpha < 0, return alpha = 0 and
    beta fitted through the origin. Raise ValueError if sizes and times differ in length or
    are not 1-D, there are fewer than two distinct sizes, a time is not finite and > 0, or a
    size is negative.
    """
    # YOUR CODE
    raise NotImplementedError("fit_alpha_beta")


# ---- Exercise 4: one-shot and two-shot all-reduce over peer memory ----------------------
# On GPUs joined by NVLink every rank can read and write every other rank's buffer directly;
# what it cannot do is know when a peer's write has landed, except through a barrier. Here
# the ranks are simulated: `bufs` (layer2_comm.PeerBuffers, made by the notebook or the
# grader) holds one buffer of at least n elements per rank and gives you exactly these:
#     bufs.read(reader, owner, start, stop) -> tensor   rank `reader` loads owner's [start:stop]
#     bufs.write(writer, owner, start, values)          rank `writer` stores into owner's buffer
#     bufs.barrier()                                    every rank meets; writes before it are
#                                                       visible to everyone after it
# Write your function phase by phase: a loop over the ranks does what every rank does in that
# phase (on GPUs they do it at the same time), then `bufs.barrier()`, then the next phase.
# Within one phase a rank must not read what another rank wrote, nor write what another rank
# read or wrote: `bufs` raises RaceError when you do (on GPUs that would be a silent, sometimes
# wrong answer). It also counts the elements each rank reads from and writes into *other*
# ranks' buffers (bufs.remote_read[r], bufs.remote_written[r]) and the barriers: the grader
# checks them against the algorithm. Sum in float32 in rank order 0, 1, ..., p-1 and cast the
# total back to the input dtype, so that every rank gets the same bits.
def one_shot_all_reduce(inputs: Sequence[torch.Tensor], bufs) -> list[torch.Tensor]:
    """inputs[r] is rank r's tensor (same shape and dtype for every r; p = len(inputs)).
    Return a list whose entry r is rank r's result: the sum over ranks, inputs[r]'s shape.

    One-shot: each rank writes its input into its own buffer (flattened, from 0); barrier;
    each rank reads all p buffers [0:n] and sums them. One barrier; each rank reads (p-1) n
    elements from its peers and writes none into them.
    """
    # YOUR CODE
    raise NotImplementedError("one_shot_all_reduce")


def two_shot_all_reduce(inputs: Sequence[torch.Tensor], bufs) -> list[torch.Tensor]:
    """Same contract as one_shot_all_reduce; reduce-scatter then all-gather through the buffers.

    Two-shot: each rank writes its input into its own buffer; barrier; rank r owns segment
    r = segment_bounds(n, p)[r]: it reads that segment from every buffer, sums it, and writes
    the sum into that segment of every buffer (its own included); barrier; each rank reads its
    own buffer [0:n], which now holds the whole sum. Two barriers; rank r reads (p-1) x |seg r|
    elements from its peers and writes (p-1) x |seg r| into them: 2(p-1)/p of the tensor in
    all, a ring's traffic in 2 steps instead of 2(p-1).
    """
    # YOUR CODE
    raise NotImplementedError("two_shot_all_reduce")
