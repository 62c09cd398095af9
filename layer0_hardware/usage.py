"""Mistakes in what a user asked for: one clear line and exit code 2, never a traceback.

Every command of every layer runs through `run_command` — `stack run/bench --layer N`
(the CLI takes it from layer 0's entry point) and each layer's `python -m` entry. The rule
lives here once:

- The layers raise `ValueError` (or `UsageError`, a subclass for command-line mistakes) for
  bad values and `FileNotFoundError` & co. for bad paths. Those are the user's to fix:
  `error: <message>` on stderr, exit code 2 (argparse's code for a usage error).
- Any other exception is a bug in the layer: its traceback is shown as usual.
- `STACK_DEBUG=1` shows the traceback of user errors too (a ValueError raised deep inside a
  layer can be a bug after all).

`--device` is checked before the command starts, since asking a CPU-only torch for CUDA
otherwise ends, deep inside torch, in `AssertionError: Torch not compiled with CUDA enabled`.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

import torch

#: Set to 1 to see the full traceback of an error the user caused.
DEBUG_ENV = "STACK_DEBUG"
#: The exit code of a usage error (argparse uses the same).
USAGE_EXIT = 2


class UsageError(ValueError):
    """A command-line value that cannot work: the message says which and why."""


#: Exceptions that mean "the input was wrong", not "the code is wrong".
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
    PermissionError,
)


def check_device(name: str) -> torch.device:
    """`name` as a torch.device this machine can run, else UsageError saying why not.

    "auto" is accepted (the layers pick the best device themselves)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {name!r} is not a device: use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise UsageError(f"--device {name}: the layers run on cpu or cuda, not {dev.type}")
    if torch.version.cuda is None:
        raise UsageError(f"--device {name}: CUDA is not available in this torch build "
                         f"(torch {torch.__version__} is CPU-only); use --device cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise UsageError(f"--device {name}: no CUDA GPU is visible (torch {torch.__version__}, "
                         f"CUDA {torch.version.cuda}); use --device cpu")
    if dev.index is not None and dev.index >= count:
        raise UsageError(f"--device {name}: this machine has {count} CUDA GPU(s), "
                         f"cuda:0 to cuda:{count - 1}")
    return dev


def device_values(argv: Sequence[str]) -> list[str]:
    """Every value given to --device in argv (`--device X` or `--device=X`)."""
    values = []
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            values.append(argv[i + 1])
        elif arg.startswith("--device="):
            values.append(arg.partition("=")[2])
    return values


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (a FileNotFoundError from open() has no args)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename and str(exc.filename) not in text:
        text = f"{text}: {exc.filename}"
    return text


def run_command(command: Callable[[list[str]], int], argv: Sequence[str]) -> int:
    """Run a layer's command (`run`, `bench`, `info`) on argv and return its exit code;
    a user's mistake becomes `error: <message>` on stderr and exit code 2."""
    argv = list(argv)
    try:
        for name in device_values(argv):
            check_device(name)
        return command(argv)
    except USER_ERRORS as exc:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return USAGE_EXIT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
