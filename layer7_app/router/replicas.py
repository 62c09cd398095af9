"""The router's view of its replicas: each one's health and load, and the health checker.

A replica is *available* when its last health check passed and it is not draining (the
autoscaler drains a replica before stopping it: no new requests, in-flight ones finish).
Health: GET /health every `interval` seconds with a `timeout`; a 200 marks it healthy, an
error or any other status unhealthy. A request that cannot even connect also marks its
replica unhealthy at once, so the next requests go elsewhere without waiting for a check.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(eq=False)
class Replica:
    """One layer-6 server behind the router. `handle`: the ServerHandle when the autoscaler
    started it (None for a replica given by URL)."""

    url: str
    healthy: bool = True
    draining: bool = False
    in_flight: int = 0  # requests through this router, not yet finished
    picked: int = 0
    served: int = 0
    failed: int = 0
    handle: Any = field(default=None, repr=False)

    @property
    def available(self) -> bool:
        return self.healthy and not self.draining

    def state(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "draining": self.draining,
                "in_flight": self.in_flight, "served": self.served, "failed": self.failed,
                "managed": self.handle is not None}


def normalize_url(url: str) -> str:
    """'http://h:p/' or 'http://h:p/v1' -> 'http://h:p'; ValueError if not http(s)."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")) or len(url.split("//", 1)[1]) == 0:
        raise ValueError(f"a replica URL must look like http://HOST:PORT, got {url!r}")
    return url


class ReplicaSet:
    """The replicas and their health checker (a task on the router's event loop)."""

    def __init__(self, urls: list[str], *, interval: float = 1.0, timeout: float = 2.0) -> None:
        self.replicas: list[Replica] = []
        for u in urls:
            self.add(normalize_url(u))
        self.interval, self.timeout = interval, timeout
        self._task: asyncio.Task | None = None

    def add(self, url: str, handle: Any = None) -> Replica:
        if any(r.url == url for r in self.replicas):
            raise ValueError(f"replica {url} is given twice")
        r = Replica(url, handle=handle)
        self.replicas.append(r)
        return r

    def remove(self, replica: Replica) -> None:
        if replica in self.replicas:
            self.replicas.remove(replica)

    def available(self) -> list[Replica]:
        return [r for r in self.replicas if r.available]

    async def check(self, client: httpx.AsyncClient, replica: Replica) -> bool:
        try:
            resp = await client.get(replica.url + "/health", timeout=self.timeout)
            replica.healthy = resp.status_code == 200
        except httpx.HTTPError:
            replica.healthy = False
        return replica.healthy

    async def check_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self.check(client, r) for r in list(self.replicas)))

    def start(self, client: httpx.AsyncClient) -> None:
        async def loop() -> None:
            while True:
                await self.check_all(client)
                await asyncio.sleep(self.interval)
        self._task = asyncio.create_task(loop(), name="router-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
