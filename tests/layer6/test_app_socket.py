"""The listening socket bind() makes: connections accepted on it send small writes at once.

asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose proto is IPPROTO_TCP;
a socket made with proto 0 kept Nagle, which held each SSE chunk behind the unacknowledged
response headers until the client's delayed ACK (~40 ms) on a keep-alive connection."""
from __future__ import annotations

import asyncio
import socket

from layer6_serving.app_thread import bind


def test_accepted_connections_have_nodelay() -> None:
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    seen: list[int] = []

    class Proto(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            s = transport.get_extra_info("socket")
            seen.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Proto, sock=sock)
        async with server:
            _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
            for _ in range(100):  # bounded: connection_made runs within a few loop turns
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(main())
    assert seen and seen[0] != 0
