"""Helpers the layer-6 engine tests share."""
from __future__ import annotations

import asyncio


async def wait_idle(engine, limit_s: float = 10.0) -> None:
    """Wait (bounded) until the engine tracks no request."""
    for _ in range(int(limit_s / 0.01)):
        if engine.snapshot.requests == 0 and engine.snapshot.running == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.snapshot}")
