"""An ASGI app served by uvicorn on a background thread: the one way this stack runs a server
in-process (layer 6's model server, layer 7's router and trace), the foreground loop that
`stack serve` / `stack route` wait in, and `wait_healthy` for a server in a process of its own."""
from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import uvicorn


def wait_healthy(url: str, proc, *, timeout: float, name: str, poll_s: float = 0.2,
                 tail: Callable[[], str] = str) -> None:
    """Poll `url` (a health endpoint) until it answers 200. RuntimeError when `proc` (the
    subprocess.Popen serving it) exits first, or once `timeout` seconds have passed; `tail()`
    is added to the message (e.g. the last lines of the server's log)."""
    import httpx  # only where a server runs in a process of its own

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} before answering "
                               f"{url}{tail()}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not answer {url} within {timeout:g} s{tail()}")
        time.sleep(poll_s)


def bind(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening, non-blocking socket on host:port (port 0: the OS picks a free one)."""
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # without it Nagle holds an SSE chunk behind the unacknowledged headers until the
    # client's delayed ACK (~40 ms) on a keep-alive connection.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                         socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:  # a port in use is the user's to change: say so in one line
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({exc.strerror}); "
                      "pick another --port") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class AppThread:
    """Serve `app` on an already bound `sock` until stop(); returns once uvicorn accepts
    requests (RuntimeError if it does not within start_timeout seconds)."""

    def __init__(self, app: Any, sock: socket.socket, *, name: str = "uvicorn",
                 start_timeout: float = 30.0, stop_timeout: float = 10.0) -> None:
        host, port = sock.getsockname()[:2]
        self.host, self.port, self.url = host, port, f"http://{host}:{port}"
        self._stop_timeout = stop_timeout
        config = uvicorn.Config(app, log_level="warning", access_log=False,
                                              timeout_keep_alive=30, timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name=f"{name}-{port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop accepting and end the uvicorn thread."""
        self._server.should_exit = True
        self._thread.join(self._stop_timeout)


class _Stoppable(Protocol):
    alive: bool

    def stop(self) -> None: ...


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_until_interrupted(handle: _Stoppable) -> None:
    """Wait while `handle` serves; Ctrl-C or SIGTERM (a service manager's stop) ends it
    cleanly with handle.stop()."""
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while handle.alive:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        handle.stop()
