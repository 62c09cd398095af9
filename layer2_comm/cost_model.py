"""The alpha-beta cost model: how long a collective should take, before we time it.

Sending one message of ``n`` bytes over one link costs ``alpha + beta * n`` seconds:
``alpha`` is the fixed latency (software, launch, handshake — microseconds), ``beta`` the
seconds per byte (1 / link bandwidth). A collective algorithm is a schedule of such
messages, so its cost is (number of sequential steps) x alpha + (bytes on the busiest
link, summed over the steps) x beta. With ``p`` ranks and a message of ``m`` bytes:

    algorithm                 steps            bytes per rank on the wire
    ring_all_reduce           2(p-1)           2(p-1)/p * m      (reduce-scatter + all-gather)
    tree_all_reduce           log2(p) (+2)     log2(p) * m       (recursive doubling)
    ring_all_gather           p-1              (p-1)/p * m       (m = the gathered output)
    ring_reduce_scatter       p-1              (p-1)/p * m       (m = the full input)
    broadcast_tree            ceil(log2 p)     ceil(log2 p) * m  (binomial tree)
    broadcast_chain           p-1 + k-1        (p-1+k-1) * m/k   (k pipelined chunks)
    all_to_all                p-1              (p-1)/p * m       (pairwise exchange)
    hierarchical_all_reduce   tree in node, ring across node leaders, tree in node
    one_shot_all_reduce       1 barrier        (p-1) * m         (read every peer's buffer)
    two_shot_all_reduce       2 barriers       2(p-1)/p * m      (reduce-scatter + all-gather
                                                                   through peer memory)
For the last two (peer_all_reduce.py) ``alpha`` is one barrier over NVLink, and the bytes are
loads and stores into peers' memory, all peers at once, rather than p-1 sequential messages.

Ring moves the fewest bytes (bandwidth-optimal) but takes the most steps; recursive
doubling takes the fewest steps but sends the whole message at each one. So tree wins
for small messages (latency-bound) and ring for large ones (bandwidth-bound), and
`crossover` finds the size where they trade places. Non-power-of-two ``p`` costs
recursive doubling two extra steps (the extra ranks fold in first and are sent the
result last). The model ignores reduction arithmetic, link contention and the
pipelining NCCL does within a step, so it is a floor — which is what makes it useful:
measured / predicted says how much time goes to things the model leaves out.

Sizes ``m`` are counted the way nccl-tests counts them: the full buffer (the reduced
tensor, the gathered output, the scattered input, each rank's whole send buffer).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AlphaBeta:
    """One link: ``alpha_s`` seconds of latency per message, ``beta_s_per_byte`` per byte."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0 and self.beta_s_per_byte >= 0):
            raise ValueError(f"alpha and beta must be >= 0, got {self.alpha_s}, "
                             f"{self.beta_s_per_byte}")

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
        """Seconds to send one message of ``nbytes`` over this link."""
        return self.alpha_s + self.beta_s_per_byte * nbytes


# Rough datasheet links (per direction) for worked examples; measure yours with `bench`.
LINKS: dict[str, AlphaBeta] = {
    "nvlink4 (H100/H200 SXM, 450 GB/s)": AlphaBeta.from_link(3.0, 450.0),
    "pcie5 x16 (~64 GB/s)": AlphaBeta.from_link(5.0, 64.0),
    "pcie4 x16 (~32 GB/s)": AlphaBeta.from_link(5.0, 32.0),
    "infiniband ndr (400 Gb/s = 50 GB/s)": AlphaBeta.from_link(5.0, 50.0),
}

ALGORITHMS = (
    "ring_all_reduce", "tree_all_reduce", "ring_all_gather", "ring_reduce_scatter",
    "broadcast_tree", "broadcast_chain", "all_to_all", "hierarchical_all_reduce",
    "one_shot_all_reduce", "two_shot_all_reduce",
)


def _log2_ceil(p: int) -> int:
    return (p - 1).bit_length()  # ceil(log2 p) for p >= 1


def _doubling_steps(p: int) -> int:
    """Recursive doubling over the largest power of two <= p, +2 fold steps otherwise."""
    core = p.bit_length() - 1
    return core if p & (p - 1) == 0 else core + 2


def predict(algorithm: str, nbytes: float, world: int, ab: AlphaBeta, *, chunks: int = 4,
            ranks_per_node: int | None = None, inter: AlphaBeta | None = None) -> float:
    """Predicted seconds for ``algorithm`` on ``nbytes`` (nccl-tests' size) over ``world`` ranks.

    ``chunks``: pipeline depth of broadcast_chain. For hierarchical_all_reduce,
    ``ranks_per_node`` is required; ``ab`` is the link inside a node and ``inter``
    (default ``ab``) the link between nodes.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    p, m, a, b = world, float(nbytes), ab.alpha_s, ab.beta_s_per_byte
    if p == 1:
        return 0.0  # nothing leaves the rank
    if algorithm == "ring_all_reduce":
        return 2 * (p - 1) * a + 2 * (p - 1) / p * m * b
    if algorithm == "one_shot_all_reduce":
        return a + (p - 1) * m * b
    if algorithm == "two_shot_all_reduce":
        return 2 * a + 2 * (p - 1) / p * m * b
    if algorithm == "tree_all_reduce":
        return _doubling_steps(p) * (a + m * b)
    if algorithm in ("ring_all_gather", "ring_reduce_scatter", "all_to_all"):
        return (p - 1) * (a + m / p * b)
    if algorithm == "broadcast_tree":
        return _log2_ceil(p) * (a + m * b)
    if algorithm == "broadcast_chain":
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        return (p - 1 + chunks - 1) * (a + m / chunks * b)
    return _hierarchical(m, p, ab, ranks_per_node, inter or ab)


def _hierarchical(m: float, p: int, intra: AlphaBeta, g: int | None, inter: AlphaBeta) -> float:
    """Reduce to a node leader (binomial tree), ring all-reduce across leaders, broadcast back."""
    if g is None or g < 1 or p % g:
        raise ValueError("hierarchical_all_reduce needs ranks_per_node "
                         f"dividing world={p}, got {g}")
    in_node = _log2_ceil(g) * intra.message(m)
    return 2 * in_node + predict("ring_all_reduce", m, p // g, inter)


def _line(algorithm: str, world: int, ab: AlphaBeta, **kw) -> tuple[float, float]:
    """(intercept, slope) of the prediction, which is linear in the message size."""
    big = 1e12
    t0 = predict(algorithm, 0, world, ab, **kw)
    return t0, (predict(algorithm, big, world, ab, **kw) - t0) / big


def crossover(alg_a: str, alg_b: str, world: int, ab: AlphaBeta, **kw) -> float | None:
    """Message size in bytes where the two predictions are equal; None if they never cross.

    Below it the algorithm with the smaller latency term is faster, above it the one
    with the smaller bandwidth term. E.g. ring vs tree all-reduce on 4 ranks:
    tree = 2(a + m b), ring = 6a + 1.5 m b, equal at m = 8a/b.
    """
    a0, a1 = _line(alg_a, world, ab, **kw)
    b0, b1 = _line(alg_b, world, ab, **kw)
    if math.isclose(a1, b1, rel_tol=1e-9, abs_tol=0.0):
        return None
    m = (b0 - a0) / (a1 - b1)
    return m if m > 0 else None


def fit_alpha_beta(
    sizes: Sequence[float], times: Sequence[float], *, relative: bool = True
) -> AlphaBeta:
    """Least-squares fit of ``t = alpha + beta * n`` to one-way point-to-point times.

    Ping-pong timings span bytes to megabytes, so plain least squares would let the big
    messages drown out the small ones that carry alpha; ``relative=True`` minimises
    relative error instead (each row weighted by 1/t). A negative coefficient (noise)
    is clamped to 0 and the other refitted, so the result is always a physical link.
    """
    n = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if n.shape != t.shape or n.ndim != 1:
        raise ValueError("sizes and times must be 1-D and equally long, "
                         f"got {n.shape} and {t.shape}")
    if len(np.unique(n)) < 2:
        raise ValueError("need at least two distinct message sizes to fit alpha and beta")
    if not (np.all(t > 0) and np.all(n >= 0) and np.all(np.isfinite(t))):
        raise ValueError("times must be finite and > 0 and sizes >= 0")
    w = 1.0 / t if relative else np.ones_like(t)
    design = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    if beta < 0:  # time does not grow with size: all latency
        alpha, beta = float(np.sum(w * w * t) / np.sum(w * w)), 0.0
    elif alpha < 0:  # through the origin: all bandwidth
        alpha, beta = 0.0, float(np.sum(w * w * n * t) / np.sum(w * w * n * n))
    return AlphaBeta(float(alpha), float(beta))


# nccl-tests' bus-bandwidth factors: algbw x factor = the bandwidth each link must carry,
# comparable across world sizes and with the link's datasheet figure.
_BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,
}


def collective_of(name: str) -> str:
    """The collective an algorithm implements: ``ring_all_reduce`` -> ``all_reduce``."""
    for kind in _BUS_FACTORS:
        if kind in name:
            return kind
    raise ValueError(f"unknown collective {name!r}; known: {', '.join(_BUS_FACTORS)} "
                     f"(or an algorithm name containing one)")


def busbw(algbw: float, collective: str, world: int) -> float:
    """nccl-tests' bus bandwidth: ``algbw`` (bytes / time) x the collective's factor."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    return algbw * _BUS_FACTORS[collective_of(collective)](world)
