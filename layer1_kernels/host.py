"""Host-side launch arithmetic in plain Python.

Triton 3.6's `triton.cdiv` and `triton.next_power_of_2` are ConstexprFunctions: called from
host code each call runs an import and unwraps its arguments, a few microseconds apiece on
a slow host. A 2048-token prefill layer called them ~11 times to size its launches, so the
hot launch paths use these instead (same results for the ints they get).
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n for n >= 1 (0 for 0), as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
