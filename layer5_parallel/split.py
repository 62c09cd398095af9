"""Cutting n things into nearly equal contiguous parts: prompts over data-parallel replicas,
decoder layers over pipeline stages."""
from __future__ import annotations


def even_ranges(n: int, parts: int) -> list[range]:
    """range(n) cut into `parts` contiguous ranges whose sizes differ by at most one (the
    earlier ones get the extra items; with parts > n the last ones are empty)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append(range(start, stop))
        start = stop
    return out
