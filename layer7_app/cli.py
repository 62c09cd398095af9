"""The `stack` command: one front door to every layer of the course.

Layers are found through the `llm_stack.layers` entry points (see pyproject.toml), never
imported by name, so the CLI respects the layer rule and a layer that is not built yet
simply does not appear. Each entry point is a module with `TITLE`, `run(argv)`,
`bench(argv)` (and, for layer 0, `info(argv)`), each returning an exit code.

Errors: every layer command runs through layer 0's `run_command` (the one rule, shared with
each layer's `python -m` entry): a mistake in what the user asked for (a ValueError,
FileNotFoundError, UsageError, a --device this machine lacks) prints `error: <message>` and
exits 2; `STACK_DEBUG=1` shows its traceback. Any other exception is a bug and shows its
traceback. Usage mistakes caught by the option parsers (click's for `stack` itself, argparse's
for each command's own options) are one `error:` line on stderr and exit 2 as well, never a
usage block. To add a command, write a function decorated with `@app.command()`.

Exit: the commands that serve (`serve`, `chat`, `route`) leave through `os._exit` once they
have shut down cleanly. Interpreter finalization after a server ran has nothing left to do
but tear down extension modules, and some (nanobind-built ones, such as newer Triton's) print
"nanobind: leaked ..." reports then about objects that threads still held: noise that would
glue onto the last real line a user reads.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup

from . import grading

LAYER_GROUP = "llm_stack.layers"
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}
HELP_FLAGS = ("--help", "-h")

SERVING = ("serve", "chat", "route")  # commands that leave through os._exit (see above)


def _click_error(name: str) -> type[Exception]:
    """click's exception classes as typer raises them (newer typer vendors its own click)."""
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)


UsageError, ClickException = _click_error("UsageError"), _click_error("ClickException")
NoArgsIsHelpError: type[Exception] = getattr(sys.modules[UsageError.__module__],
                                             "NoArgsIsHelpError", type("NoArgsIsHelp", (), {}))


def _argparse_error(self: argparse.ArgumentParser, message: str) -> NoReturn:
    """argparse's `error`, as one line: `error: <prog>: <message> ...` on stderr, exit 2."""
    print(f"error: {self.prog}: {message} (`{self.prog} --help` lists the options)",
          file=sys.stderr)
    raise SystemExit(2)


@contextmanager
def one_line_usage_errors() -> Iterator[None]:
    """While it lasts, every argparse parser without an `error` of its own reports a usage
    mistake in one line (the layers' commands build plain argparse parsers)."""
    saved = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = _argparse_error  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.error = saved  # type: ignore[method-assign]


class OneLineErrors(TyperGroup):
    """The `stack` group: click's usage errors as one `error:` line on stderr (exit 2)
    instead of a usage block, and argparse's the same inside every command."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        try:
            with one_line_usage_errors():
                rv = super().main(*args, standalone_mode=False, **kwargs)
            code = rv if isinstance(rv, int) else 0
        except NoArgsIsHelpError as exc:  # bare `stack`: the help
            typer.echo(exc.format_message())  # type: ignore[attr-defined]
            code = 0
        except UsageError as exc:
            ctx = getattr(exc, "ctx", None)
            where = ctx.command_path if ctx is not None else "stack"
            typer.echo(f"error: {' '.join(exc.format_message().split())} "  # type: ignore
                       f"(`{where} --help` lists the options)", err=True)
            code = 2
        except ClickException as exc:
            typer.echo(f"error: {' '.join(exc.format_message().split())}", err=True)  # type: ignore
            code = exc.exit_code  # type: ignore[attr-defined]
        except typer.Abort:
            typer.echo("interrupted", err=True)
            code = 130
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    cls=OneLineErrors,
    help="llm-stack: an LLM serving system built layer by layer (L0 hardware to L7 app).",
    no_args_is_help=True,
    add_completion=False,
)


def built_layers() -> dict[int, EntryPoint]:
    """The layers registered under the entry-point group, by number."""
    return {int(ep.name): ep for ep in entry_points(group=LAYER_GROUP)}


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


def _load_layer(layer: int) -> ModuleType:
    layers = built_layers()
    if layer not in layers:
        listing = ", ".join(str(n) for n in sorted(layers)) or "none"
        raise _fail(f"layer {layer} is not available; built layers: {listing}")
    return layers[layer].load()


@app.command()
def layers() -> None:
    """List the layers that are built and registered."""
    for number, ep in sorted(built_layers().items()):
        title = getattr(ep.load(), "TITLE", "")
        typer.echo(f"{number}  {ep.value.split('.')[0]}  {title}")


def _layer_command(layer: int, command: str, argv: list[str]) -> int:
    """Layer `layer`'s `command` on argv, through layer 0's user-error rule (see above)."""
    function = getattr(_load_layer(layer), command)
    return _load_layer(0).run_command(function, argv)


def _run_or_help(ctx: typer.Context, layer: int | None, command: str) -> None:
    """`--layer N` given: hand every other option (--help included) to the layer, so
    `stack run --layer 3 --help` shows layer 3's own options. Without it, this command's help."""
    if layer is None:
        if any(arg in HELP_FLAGS for arg in ctx.args):
            typer.echo(ctx.get_help())
            raise typer.Exit(code=0)
        raise _fail(f"stack {command} needs --layer N (built layers: "
                    f"{', '.join(str(n) for n in sorted(built_layers()))}); "
                    f"`stack {command} --layer N --help` lists that layer's options")
    raise typer.Exit(code=_layer_command(layer, command, list(ctx.args)))


@app.command(context_settings=PASS_THROUGH)
def info(ctx: typer.Context) -> None:
    """Print the device summary: CPU, GPUs, versions, topology, matched datasheet."""
    raise typer.Exit(code=_layer_command(0, "info", list(ctx.args)))


LAYER_OPTION = typer.Option(None, "--layer", "-l", help="Layer number, 0-7.")


@app.command(context_settings=PASS_THROUGH, add_help_option=False)
def run(ctx: typer.Context, layer: int | None = LAYER_OPTION) -> None:
    """Run layer N's demo (the same as `python -m layerN_...`).

    Other options go to the layer: `stack run --layer N --help` lists them."""
    _run_or_help(ctx, layer, "run")


@app.command(context_settings=PASS_THROUGH, add_help_option=False)
def bench(ctx: typer.Context, layer: int | None = LAYER_OPTION) -> None:
    """Run layer N's benchmark (ratios to a reference, fractions of the ceiling).

    Other options go to the layer: `stack bench --layer N --help` lists them."""
    _run_or_help(ctx, layer, "bench")


@app.command()
def grade(
    lab: int = typer.Option(..., "--lab", help="Lab number."),
    submission: Path | None = typer.Option(
        None, help="Grade this exercises.py instead of the lab's working file."
    ),
    reference: bool = typer.Option(
        False, "--reference", help="Grade the reference (layer package or lab answer key)."
    ),
    json_path: Path | None = typer.Option(
        None, "--json", help="Write a Gradescope-format results.json here."
    ),
    timeout: float = typer.Option(30.0, help="Seconds each test may run before it fails."),
) -> None:
    """Grade a lab: the student's working exercises.py, a --submission, or the --reference."""
    if reference and submission is not None:
        raise _fail("--reference and --submission are exclusive")
    try:
        report = grading.grade_lab(
            lab, submission=submission, reference=reference, test_timeout=timeout
        )
    except (FileNotFoundError, ValueError) as exc:
        raise _fail(str(exc)) from None
    grading.print_report(report)
    if json_path is not None:
        report.write_json(json_path)
        typer.echo(f"wrote {json_path}")


@app.command(context_settings=PASS_THROUGH, add_help_option=False)
def chat(ctx: typer.Context) -> None:
    """Serve the chat web app (a model server in-process, or --server URL).

    `stack chat --help` lists its options."""
    from .chat import main as chat_main  # the web stack loads only for this command

    raise typer.Exit(code=chat_main(list(ctx.args)))


@app.command(context_settings=PASS_THROUGH, add_help_option=False)
def serve(ctx: typer.Context) -> None:
    """Serve models over an OpenAI-compatible HTTP API (layer 6).

    `stack serve --model course [--model M2] [--port 8000] [--tp N] [--api-key K]`;
    `--dp N`: N replicas (one per GPU) behind one router; `stack serve --help` lists options."""
    if any(a == "--dp" or a.startswith("--dp=") for a in ctx.args):
        from .router.data_parallel import serve_dp_main  # replicas + router

        raise typer.Exit(code=serve_dp_main(list(ctx.args)))
    import layer6_serving  # the serving stack loads only for this command

    raise typer.Exit(code=layer6_serving.serve_main(list(ctx.args)))


@app.command(context_settings=PASS_THROUGH, add_help_option=False)
def models(ctx: typer.Context) -> None:
    """Model names and the model cache: list | pull NAME | info PATH.

    `stack models --help` lists its options."""
    raise typer.Exit(code=_layer_command(3, "models", list(ctx.args)))


@app.command(context_settings=PASS_THROUGH, add_help_option=False)
def route(ctx: typer.Context) -> None:
    """Route OpenAI requests across layer-6 replicas (round robin, least loaded, prefix).

    `stack route --replica URL ... --policy round_robin|least_loaded|prefix_aware [--port P]`,
    or autoscale local ones with `--model M --min-replicas 1 --max-replicas 3`.
    `stack route --help` lists its options."""
    from .router import route_main  # the web stack loads only for this command

    raise typer.Exit(code=route_main(list(ctx.args)))


@app.command(context_settings=PASS_THROUGH, add_help_option=False)
def trace(ctx: typer.Context) -> None:
    """Follow one request from layer 7 down to the kernels, with time per layer.

    `stack trace "ROMEO.\\n" [--max-tokens N] [--no-router] [--out FILE]` writes a
    Chrome/Perfetto trace and prints the time per layer. `stack trace --help` lists its options."""
    from .trace import trace_main  # the web stack and the profiler load only for this command

    raise typer.Exit(code=trace_main(list(ctx.args)))


@app.command(context_settings=PASS_THROUGH, add_help_option=False)
def plan(ctx: typer.Context) -> None:
    """Plan a TP/PP/DP layout: per-rank memory, predicted decode speed, and why.

    `stack plan --model DIR_OR_SHAPE --gpus N [--device h100]`; `stack plan --help` lists its
    options."""
    # Not through run_command: --device here names a GPU model, not a device of this machine;
    # layer 5's plan() applies the same one-line, exit-2 rule to the user's mistakes itself.
    raise typer.Exit(code=_load_layer(5).plan(list(ctx.args)))


def _leave(code: int) -> NoReturn:
    """Exit now, without interpreter finalization (see the module docstring): stdio flushed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main(argv: list[str] | None = None, leave: Callable[[int], Any] = _leave) -> int:
    """Console-script entry point: the exit code of the command. A serving command ends
    through `leave` (os._exit) once it has stopped cleanly."""
    args = list(sys.argv[1:] if argv is None else argv)
    code = app(args=args, prog_name="stack", standalone_mode=False)
    code = code if isinstance(code, int) else 0
    if any(a in SERVING for a in args[:1]):
        leave(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
