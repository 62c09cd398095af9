"""Autoscaling: the router starts and stops local replicas on queue depth.

The signal is the router's own: requests in flight per available replica (sent, not yet
answered: each replica's running + waiting, as far as this router is concerned). It needs
no scrape and reacts within one tick. Every `interval` seconds:

- above `up_at` per replica and fewer than `max_replicas`: start one more replica
  (layer 6's `start_server` in this process: its engine gets its own thread; on a real
  deployment this would launch a process or a pod, the rule is the same);
- below `down_at` per replica for `cooldown` seconds and more than `min_replicas`: drain the
  least-busy replica this autoscaler started (no new requests; in-flight ones finish, for at
  most `drain_timeout` s), then stop it.

Scale-up is quick and scale-down slow on purpose: a replica started too early costs memory,
one stopped too early costs a cold start (seconds of load and warm-up) in the next burst.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import layer6_serving as l6

from .replicas import Replica, ReplicaSet


class Autoscaler:
    """Keeps between min_replicas and max_replicas replicas of `model` (engine_kwargs go to
    layer 6's start_server). `events` records each change: {t, action, replicas, load}."""

    def __init__(self, model: str = "course", *, min_replicas: int = 1, max_replicas: int = 2,
                 up_at: float = 2.0, down_at: float = 0.5, interval: float = 0.5,
                 cooldown: float = 3.0, drain_timeout: float = 30.0, **engine_kwargs: Any) -> None:
        if not 1 <= min_replicas <= max_replicas:
            raise ValueError(f"need 1 <= --min-replicas <= --max-replicas, got {min_replicas} "
                             f"and {max_replicas}")
        if not 0 <= down_at < up_at:
            raise ValueError(f"need 0 <= down_at < up_at, got {down_at} and {up_at}")
        self.model, self.engine_kwargs = model, engine_kwargs
        self.min, self.max = min_replicas, max_replicas
        self.up_at, self.down_at = up_at, down_at
        self.interval, self.cooldown, self.drain_timeout = interval, cooldown, drain_timeout
        self.events: list[dict[str, Any]] = []
        self._task: asyncio.Task | None = None
        self._replicas: ReplicaSet | None = None
        self._t0 = time.monotonic()
        self._quiet_since: float | None = None

    def managed(self) -> list[Replica]:
        return [r for r in self._replicas.replicas if r.handle is not None] if self._replicas \
            else []

    def load(self) -> float:
        """Requests in flight per available replica (the queue depth this router sees)."""
        avail = self._replicas.available()
        return sum(r.in_flight for r in avail) / len(avail) if avail else float("inf")

    async def start(self, replicas: ReplicaSet) -> None:
        """Start min_replicas replicas, then the control loop."""
        self._replicas, self._t0 = replicas, time.monotonic()
        while len(self.managed()) < self.min:
            await self._scale_up("start")
        self._task = asyncio.create_task(self._loop(), name="router-autoscale")

    async def _scale_up(self, why: str) -> None:
        load = self.load() if self._replicas.available() else 0.0
        handle = await asyncio.to_thread(l6.start_server, [self.model], **self.engine_kwargs)
        self._replicas.add(handle.url, handle=handle)
        self._record(why, load)

    async def _scale_down(self) -> None:
        load = self.load()
        victim = min(self.managed(), key=lambda r: r.in_flight)
        victim.draining = True  # the policies stop choosing it now
        deadline = time.monotonic() + self.drain_timeout
        while victim.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._replicas.remove(victim)
        await asyncio.to_thread(victim.handle.stop)
        self._record("down", load)

    def _record(self, action: str, load: float) -> None:
        self.events.append({"t": round(time.monotonic() - self._t0, 2), "action": action,
                            "replicas": len(self.managed()), "load": round(load, 2)})

    async def tick(self) -> None:
        """One decision (the loop calls it every `interval` s)."""
        load, n = self.load(), len(self.managed())
        now = time.monotonic()
        if load > self.up_at and n < self.max:
            self._quiet_since = None
            await self._scale_up("up")
        elif load < self.down_at and n > self.min:
            self._quiet_since = self._quiet_since or now
            if now - self._quiet_since >= self.cooldown:
                self._quiet_since = None
                await self._scale_down()
        else:
            self._quiet_since = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.tick()
            except Exception as e:  # noqa: BLE001 - a replica that fails to start: say so, go on
                self.events.append({"t": round(time.monotonic() - self._t0, 2),
                                    "action": "error", "error": f"{type(e).__name__}: {e}"})

    async def stop(self) -> None:
        """Stop the loop and every replica this autoscaler started."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for r in self.managed():
            self._replicas.remove(r)
            await asyncio.to_thread(r.handle.stop)
