"""The roofline model: how fast *can* an operation run on this chip?

An operation that does ``F`` floating-point operations and moves ``B`` bytes between
DRAM (HBM) and the chip can finish no sooner than ``max(F / peak_flops, B / bandwidth)``.
Its *arithmetic intensity* ``I = F / B`` (FLOP/byte) decides which term wins: below the
*ridge point* ``peak_flops / bandwidth`` the memory system is the bottleneck, above it
the arithmetic units are. Units throughout: FLOP, bytes, seconds, FLOP/s, bytes/s.
"""
from __future__ import annotations

from dataclasses import dataclass


def _check_non_negative(**values: float) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOP per byte of DRAM traffic: ``flops / nbytes``.

    Raises ValueError when ``nbytes <= 0`` (an op that moves no data has no intensity)
    or when ``flops`` is negative.
    """
    _check_non_negative(flops=flops)
    _check_positive(nbytes=nbytes)
    return flops / nbytes


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """Intensity (FLOP/byte) where the bandwidth slope meets the flat compute roof.

    Example: H100 SXM bf16, 989.4e12 FLOP/s / 3.35e12 B/s = 295 FLOP/byte.
    """
    _check_positive(peak_flops=peak_flops, bandwidth=bandwidth)
    return peak_flops / bandwidth


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """Best FLOP/s an op of this intensity can reach: ``min(peak, intensity * bandwidth)``."""
    _check_non_negative(intensity=intensity)
    _check_positive(peak_flops=peak_flops, bandwidth=bandwidth)
    return min(peak_flops, intensity * bandwidth)


def classify_bound(intensity: float, peak_flops: float, bandwidth: float) -> str:
    """``"memory"`` left of the ridge point, ``"compute"`` at or right of it."""
    _check_non_negative(intensity=intensity)
    return "compute" if intensity >= ridge_point(peak_flops, bandwidth) else "memory"


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def vector_add_cost(n: int, dtype_bytes: int = 4) -> tuple[float, float]:
    """FLOPs and bytes of ``c = a + b`` on vectors of ``n`` elements.

    flops = n (one add per element); bytes = 3 * n * dtype_bytes (read a, read b,
    write c). Intensity is 1 / (3 * dtype_bytes): ~0.083 FLOP/byte in fp32, always
    memory bound.
    """
    _check_sizes(n=n, dtype_bytes=dtype_bytes)
    return float(n), float(3 * n * dtype_bytes)


def matmul_cost(m: int, n: int, k: int, dtype_bytes: int = 2) -> tuple[float, float]:
    """FLOPs and bytes of ``C[m, n] = A[m, k] @ B[k, n]``.

    flops = 2 * m * n * k (one multiply and one add per term of each dot product);
    bytes = (m*k + k*n + m*n) * dtype_bytes, i.e. each operand read once and the result
    written once -- the minimum traffic, reached when tiles are reused from on-chip memory.
    For square n: intensity = 2n^3 / (3n^2 * dtype_bytes) = n / 3 in bf16, so large
    matmuls are compute bound.
    """
    _check_sizes(m=m, n=n, k=k, dtype_bytes=dtype_bytes)
    flops = 2.0 * m * n * k
    nbytes = float((m * k + k * n + m * n) * dtype_bytes)
    return flops, nbytes


def attention_decode_cost(
    batch: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    context_len: int,
    dtype_bytes: int = 2,
) -> tuple[float, float]:
    """FLOPs and bytes of one decode step of attention: one new query token per sequence.

    Shapes: q[batch, heads, 1, head_dim] attends to K, V[batch, kv_heads, context_len,
    head_dim] (grouped-query attention when kv_heads < heads; heads % kv_heads == 0).

    flops = 4 * batch * heads * context_len * head_dim: 2*L*d for the scores q K^T and
    2*L*d for the weighted sum P V, per query head (softmax is negligible).
    bytes = 2 * batch * kv_heads * context_len * head_dim * dtype_bytes (read K and V)
          + 2 * batch * heads * head_dim * dtype_bytes (read q, write the output).
    The K/V read dominates, so intensity is ~ heads / kv_heads / dtype_bytes FLOP/byte:
    decode attention is memory bound on every GPU.
    """
    _check_sizes(batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                 context_len=context_len, dtype_bytes=dtype_bytes)
    if heads % kv_heads != 0:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    flops = 4.0 * batch * heads * context_len * head_dim
    kv_bytes = 2 * batch * kv_heads * context_len * head_dim * dtype_bytes
    q_out_bytes = 2 * batch * heads * head_dim * dtype_bytes
    return flops, float(kv_bytes + q_out_bytes)


@dataclass(frozen=True)
class RooflinePoint:
    """One measured operation placed on the roofline.

    ``flops`` and ``nbytes`` come from a cost model (e.g. ``matmul_cost``), ``seconds``
    from a timer; the properties turn them into the plot's coordinates.
    """

    name: str
    flops: float
    nbytes: float
    seconds: float

    def __post_init__(self) -> None:
        _check_non_negative(flops=self.flops)
        _check_positive(nbytes=self.nbytes, seconds=self.seconds)

    @property
    def intensity(self) -> float:
        """FLOP per byte (x axis)."""
        return arithmetic_intensity(self.flops, self.nbytes)

    @property
    def achieved_flops(self) -> float:
        """FLOP/s reached (y axis)."""
        return self.flops / self.seconds

    @property
    def achieved_bandwidth(self) -> float:
        """Bytes/s of modelled traffic reached."""
        return self.nbytes / self.seconds
