"""Supervision of an engine process, from the server's side (EngineProcess's reader thread).

Supervision (the server side watches the engine): every turn that does something sends a
message, so a process with open requests that sends nothing for `stall_timeout` seconds is
stalled (stopped, deadlocked, swapping): `stalled_for()` says so and /health turns 503 with
the reason. A process that dies fails its open requests with EngineUnavailable (clear, and
retryable: 503), and is restarted with the same arguments; requests sent meanwhile get 503.
Restarts that keep failing (`max_restarts` failed starts in a row, or that many deaths
within a minute) make the engine fatal: `fatal` holds the reason and `stack serve` exits
non-zero with it.
"""
from __future__ import annotations

import logging
import time

from .engine_state import EngineSnapshot, EngineStepError, EngineUnavailable

log = logging.getLogger("layer6_serving")


class Supervised:
    """For EngineProcess: reads self.proc, self._requests, self._beat / _busy_since,
    self.stall_timeout, self.max_restarts; restarts through self._spawn / _handshake."""

    @property
    def down_reason(self) -> str | None:
        """Why the engine does not serve now (None: it does)."""
        if self.fatal:
            return self.fatal
        if self._error is not None:
            return str(self._error)
        if self._closed:
            return "the engine was stopped"
        if not self.proc.is_alive():
            return f"the engine process exited (code {self.proc.exitcode})"
        return None

    @property
    def open_requests(self) -> int:
        """Requests sent to the engine that have not ended (as this side knows them)."""
        return len(self._requests)

    def stalled_for(self) -> float | None:
        """Seconds without a turn from the engine while requests are open, once that passes
        stall_timeout (None: not stalled)."""
        if not self._requests:
            return None
        idle = time.monotonic() - max(self._beat, self._busy_since)
        return idle if idle > self.stall_timeout else None

    def _supervise(self) -> None:
        """The reader thread: read the engine's turns; when the process dies, fail its open
        requests and start a new one (or give up: `fatal`)."""
        while True:
            self._read()
            if self._closed:
                break
            code = self.proc.exitcode
            self._error = EngineUnavailable(
                f"the engine process of {self.name!r} died (exit code {code}); requests it was "
                f"running are lost; it is being restarted: retry shortly")
            log.error("%s", self._error)
            self._fail_all(self._error)
            self._notify("on_engine_down")
            if not self._restart():
                self._fail_all(self._error)
                break
        self._fail_all(self._error or EngineStepError("the server is shutting down"))

    def _restart(self) -> bool:
        """Start a new engine process; False (and `fatal` set) when that keeps failing."""
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < 60.0] + [now]
        if len(self._deaths) > self.max_restarts:
            self.fatal = (f"the engine process of {self.name!r} died {len(self._deaths)} times "
                          f"within a minute: giving up")
        failures = 0
        while self.fatal is None and not self._closed:
            try:
                self.outputs.close()
                self._spawn()
                self._handshake(self.start_timeout)
                if self._closed:  # stopped while it started
                    self._end_process(5.0)
                    return False
            except Exception as e:  # noqa: BLE001 - counted; the last one is reported
                failures += 1
                self._end_process(5.0)
                log.error("engine %r: restart %d failed: %s", self.name, failures, e)
                if failures >= self.max_restarts:
                    self.fatal = (f"the engine process of {self.name!r} could not be restarted "
                                  f"({failures} attempts; last: {e})")
                else:
                    time.sleep(min(2.0 ** failures, 10.0))
                continue
            with self._lock:
                self._submitted = self._dequeued = 0
            self.snapshot = EngineSnapshot(kv_blocks_total=self.info.num_blocks)
            self._beat = time.monotonic()
            self.restarts += 1
            self._error = None
            log.warning("engine %r: restarted (%d restarts)", self.name, self.restarts)
            self._notify("on_engine_up")
            return True
        if self.fatal:
            log.error("%s", self.fatal)
            self._error = EngineUnavailable(self.fatal)
        return False

    def _notify(self, event: str) -> None:
        for listener in self.listeners:
            hook = getattr(listener, event, None)
            if hook is not None:
                hook()
