"""Environment variables set for a while, then put back: for what reads os.environ once at a
moment we choose (a spawned child starts with a copy of it; layer 2's env:// init reads it)."""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def environ(**env: str | None) -> Iterator[None]:
    """os.environ with each given variable set (None: left as it is) until the block ends."""
    saved = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update({k: v for k, v in env.items() if v is not None})
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
