"""Time per layer: the traced request's wall time, cut into parts that add up to it.

Each layer's row is its *self* time: its span minus the span of the layer it waits on, so
the rows partition the client's wall time exactly (nested spans telescope):

    client + network   = client.request - router.proxy          (outside the stack)
    L7 router          = router.proxy   - server.http            (parse, choose, relay)
    L6 HTTP server     = server.http - engine.request - profiler.stop (validate, tokenize, SSE)
    tracing overhead   = profiler.stop    (stopping torch.profiler delays the last delivery)
    L6 engine queue    = engine.queue                            (submitted -> first step)
    L6 engine loop     = engine.request - queue - steps          (between steps: deliver)
    L4 step            = steps - forwards                        (schedule, sample, KV)
    L3 model forward   = forwards - kernels                      (Python around the ops)
    L1 kernels         = the ops each forward called             (torch.profiler)

The engine thread and the event loop run at the same time, so "L6 HTTP server" is the
time the request spent in the server *outside* the engine's work for it, not all the time
the server's code ran (much of that overlaps the forwards).
"""
from __future__ import annotations

from typing import Any

from .spans import Recorder


def partition(rec: Recorder, kernel_s: float) -> tuple[list[tuple[str, float]], float]:
    """[(layer, seconds)] adding up to the wall time, and the wall time."""
    wall = rec.one("client.request").dur
    router = rec.named("router.proxy")
    router_s = router[0].dur if router else None
    server_s = rec.one("server.http").dur
    engine_s = rec.one("engine.request").dur
    stop_s = sum(s.dur for s in rec.named("profiler.stop"))
    queue_s = rec.one("engine.queue").dur
    steps_s = sum(s.dur for s in rec.named("scheduler.step"))
    fwd_s = sum(s.dur for s in rec.named("model.forward"))
    outer = router_s if router_s is not None else server_s
    rows = [("client + network (outside the stack)", wall - outer)]
    if router_s is not None:
        rows.append(("L7 router (parse, choose, relay)", router_s - server_s))
    rows += [("L6 HTTP server (validate, tokenize, SSE)", server_s - engine_s - stop_s),
             ("tracing overhead (stopping the profiler)", stop_s),
             ("L6 async engine queue", queue_s),
             ("L6 engine loop between steps", engine_s - queue_s - steps_s),
             ("L4 engine step: schedule, sample", steps_s - fwd_s),
             ("L3 model forward (Python)", fwd_s - kernel_s),
             ("L1 kernels (aten ops)", kernel_s)]
    return rows, wall


def print_table(result: Any) -> None:
    """The rows as a rich table, then kernels per token and the busiest operators."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"one request, {result.tokens} tokens: time per layer (self time)")
    table.add_column("layer")
    table.add_column("ms", justify="right")
    table.add_column("% of wall", justify="right")
    for name, s in result.rows:
        table.add_row(name, f"{s * 1e3:.2f}", f"{100 * s / result.wall_s:.1f}")
    total = sum(s for _, s in result.rows)
    table.add_row("[bold]sum[/bold]", f"{total * 1e3:.2f}", f"{100 * total / result.wall_s:.1f}")
    table.add_row("[bold]wall (client)[/bold]", f"{result.wall_s * 1e3:.2f}", "100.0")
    console.print(table)
    k = result.kernels
    console.print(f"kernels: {k['leaf_ops']} leaf aten ops in {result.tokens} steps = "
                  f"{k['leaf_ops'] / result.tokens:.0f} per token")
    ops = Table(title="busiest operators called by the forwards")
    for col in ("op", "calls", "ms"):
        ops.add_column(col, justify="left" if col == "op" else "right")
    for name, calls, t in k["top_ops"]:
        ops.add_row(name, str(calls), f"{t * 1e3:.2f}")
    console.print(ops)
