"""A rich progress bar over a fixed list of named steps, or nothing when disabled."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


@contextlib.contextmanager
def steps_progress(steps: list[str], *, enabled: bool = True, title: str = "working",
                   console: Console | None = None) -> Iterator[Callable[[], None]]:
    """Yield ``advance()``: each call marks the current step done and names the next."""
    if not enabled or not steps:
        yield lambda: None
        return
    progress = Progress(TextColumn("{task.description}"), BarColumn(),
                        TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                        console=console, transient=False)
    with progress:
        task = progress.add_task(f"{title}: {steps[0]}", total=len(steps))
        done = 0

        def advance() -> None:
            nonlocal done
            done += 1
            label = steps[done] if done < len(steps) else "done"
            progress.update(task, advance=1, description=f"{title}: {label}")

        yield advance
