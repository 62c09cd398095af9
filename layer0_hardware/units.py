"""Human-readable numbers: decimal units for rates (as datasheets print), binary for sizes."""
from __future__ import annotations

_DECIMAL = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""))


def _decimal(value: float, unit: str) -> str:
    for scale, prefix in _DECIMAL:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def fmt_bandwidth(bytes_per_s: float) -> str:
    """3.35e12 -> '3.35 TB/s'."""
    return _decimal(bytes_per_s, "B/s")


def fmt_flops(flops_per_s: float) -> str:
    """989.4e12 -> '989 TFLOP/s'."""
    return _decimal(flops_per_s, "FLOP/s")


def fmt_count(value: float, unit: str = "") -> str:
    """2.1e9, 'FLOP' -> '2.1 GFLOP'."""
    return _decimal(value, unit)


def fmt_bytes(nbytes: float) -> str:
    """85899345920 -> '80 GiB'."""
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def fmt_seconds(seconds: float) -> str:
    """2.1e-6 -> '2.1 us'."""
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def fmt_ratio(value: float | None) -> str:
    """0.8734 -> '87.3%'; None -> '-'."""
    return "-" if value is None else f"{100 * value:.1f}%"
