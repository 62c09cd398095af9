"""A server in its own process for the load generator: the client must not share a process
(and a GIL) with the server it measures, as in `vllm bench serve`.

    with ServerProcess(our_server_command("course", port, max_num_seqs=64), url) as srv:
        ...                       # /health answered; srv.stop() (or leaving) ends it

The child gets its own process group, so stop() (its stop signal, SIGINT unless told, then
SIGTERM, then SIGKILL) reaches anything it started too (TP workers, uvicorn); leaving the
block on an error or Ctrl-C stops it as well, so no server outlives the bench. Its output goes
to a log file, whose tail is in every error.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import layer5_parallel as l5

from ..app_thread import wait_healthy

# The server's own command line (layer 6's serve_main = `stack serve`), without the stack CLI.
_ROOT = str(Path(__file__).resolve().parent.parent)
_SERVE = "import sys; from layer6_serving import serve_main; sys.exit(serve_main(sys.argv[1:]))"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (layer 2's)."""
    return l5.free_port()


def our_server_command(model: str, port: int, *, max_num_seqs: int, num_blocks: int | None,
                       extra: Sequence[str] = ()) -> list[str]:
    """`stack serve` for one model on 127.0.0.1:port with the offline engine's batch limits."""
    cmd = [sys.executable, "-c", _SERVE, "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--max-num-seqs", str(max_num_seqs), "--max-waiting", "100000"]
    if num_blocks is not None:
        cmd += ["--num-blocks", str(num_blocks)]
    return cmd + list(extra)


class ServerProcess:
    """Start `cmd`, wait until GET url+health answers 200 (RuntimeError with the log's tail if
    the process exits first or `start_timeout` s pass), stop it on stop() or leaving."""

    def __init__(self, cmd: Sequence[str], url: str, *, name: str = "server",
                 health: str = "/health", env: dict[str, str] | None = None,
                 start_timeout: float = 300.0, stop_timeout: float = 15.0,
                 stop_signal: int = signal.SIGINT) -> None:
        self.cmd, self.url, self.name = list(cmd), url.rstrip("/"), name
        self._stop_timeout, self._stop_signal = stop_timeout, stop_signal
        self._log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)
        env = {**os.environ, **(env or {})}
        # the child imports this package as we do, even when it is not installed
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)
        try:
            self._wait_healthy(health, start_timeout)
        except BaseException:  # Ctrl-C while loading counts too
            self.stop()
            raise

    def _wait_healthy(self, health: str, timeout: float) -> None:
        wait_healthy(self.url + health, self.proc, timeout=timeout, name=self.name,
                     tail=lambda: ":\n" + self.log_tail())

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        return "\n".join("  | " + line for line in text[-lines:]) or "  | (no output)"

    def stop(self) -> int | None:
        """Ask the process group for a clean shutdown (the stop signal), escalate if it
        lingers; the exit code (None if it could not be reaped)."""
        for sig, wait in ((self._stop_signal, self._stop_timeout), (signal.SIGTERM, 5.0),
                          (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        try:  # the group may hold children the leader left behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()
        return self.proc.poll()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
