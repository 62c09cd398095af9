"""The `stack` CLI: discovery through entry points, errors, and the installed script."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from layer7_app import cli

runner = CliRunner()


def test_help_lists_every_command():
    result = runner.invoke(cli.app, ["--help"])
    assert result.exit_code == 0
    for command in ("info", "run", "bench", "grade", "layers"):
        assert command in result.output


def test_layers_come_from_entry_points():
    layers = cli.built_layers()
    assert 0 in layers and layers[0].value == "layer0_hardware.commands"
    for ep in layers.values():
        module = ep.load()
        assert callable(module.run) and callable(module.bench) and module.TITLE


@pytest.mark.parametrize("command", ["run", "bench"])
@pytest.mark.parametrize("layer", ["9", "-1"])
def test_unknown_layer_is_a_one_line_error_with_exit_2(command, layer):
    result = runner.invoke(cli.app, [command, "--layer", layer])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and f"layer {layer} is not available" in lines[0]
    assert "built layers: " in lines[0] and "0" in lines[0].split("built layers: ")[1]


def test_unbuilt_layer_is_not_listed():
    unbuilt = [n for n in range(8) if n not in cli.built_layers()]
    if not unbuilt:
        pytest.skip("every layer is built")
    result = runner.invoke(cli.app, ["run", "--layer", str(unbuilt[-1])])
    assert result.exit_code == 2 and "not available" in result.output


def test_unknown_lab_is_a_clear_error():
    result = runner.invoke(cli.app, ["grade", "--lab", "42"])
    assert result.exit_code == 2
    assert "lab 42 does not exist; available labs: 0" in result.output


def test_reference_and_submission_are_exclusive(tmp_path):
    result = runner.invoke(cli.app, ["grade", "--lab", "0", "--reference",
                                     "--submission", str(tmp_path / "x.py")])
    assert result.exit_code == 2 and "exclusive" in result.output


def test_installed_script_runs_info():
    script = shutil.which("stack") or str(Path(sys.executable).with_name("stack"))
    result = subprocess.run([script, "info"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "CPU" in result.stdout



# ---------------------------------------------------------------- a user's mistakes
# In-process through the CLI app (the `stack` script calls the same app; starting a process
# per case would cost seconds each); the installed script itself is run below.
CPU_ONLY = not torch.cuda.is_available()
MISTAKES = [
    ("run", 3, ["--model", "/nonexistent"], "/nonexistent"),
    ("run", 3, ["--model", "EMPTY_DIR"], "config.json"),  # a fresh empty folder (tmp_path)
    ("run", 3, ["--prompt", ""], "empty prompt"),
    ("run", 3, ["--max-tokens", "0"], "max_tokens"),
    ("run", 3, ["--temperature", "-1"], "temperature"),
    ("run", 4, ["--block-size", "0"], "block_size"),
    ("run", 4, ["--model", "/nonexistent"], "/nonexistent"),
    ("run", 2, ["--world", "0"], "--world"),
    ("bench", 2, ["--factor", "1"], "--factor"),
    ("run", 0, ["--device", "tpu"], "cpu, cuda or cuda:N"),
    ("bench", 0, ["--out", "/etc/hostname"], "/etc/hostname"),
]
CPU_MISTAKES = [  # mistakes only where CUDA is missing
    ("run", 3, ["--device", "cuda"], "CUDA is not available in this torch build"),
    ("run", 4, ["--device=cuda:0"], "CUDA is not available in this torch build"),
    ("run", 0, ["--device", "cuda"], "CUDA is not available in this torch build"),
    ("run", 2, ["--backend", "nccl"], "needs a CUDA GPU"),
    ("bench", 1, [], "need a CUDA GPU"),
]


def _one_error_line(stderr: str, says: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines


@pytest.mark.parametrize(
    "command, layer, args, says",
    MISTAKES + [pytest.param(*m, marks=pytest.mark.skipif(not CPU_ONLY, reason="CUDA is here"))
                for m in CPU_MISTAKES],
)
def test_a_users_mistake_is_one_line_and_exit_code_2(command, layer, args, says, monkeypatch,
                                                     tmp_path):
    if layer not in cli.built_layers():
        pytest.skip(f"layer {layer} is not built")
    monkeypatch.delenv("STACK_DEBUG", raising=False)
    # (a model folder with nothing in it: /tmp itself may hold anyone's files, a .gguf too)
    args = [str(tmp_path) if a == "EMPTY_DIR" else a for a in args]
    result = runner.invoke(cli.app, [command, "--layer", str(layer), *args])
    assert result.exit_code == 2, (result.stderr[-2000:], result.exception)
    _one_error_line(result.stderr, says)


def _stack(*args: str, **env: str) -> subprocess.CompletedProcess:
    script = shutil.which("stack") or str(Path(sys.executable).with_name("stack"))
    environ = {k: v for k, v in os.environ.items() if k != "STACK_DEBUG"}
    environ.update(COLUMNS="80", **env)
    return subprocess.run([script, *args], capture_output=True, text=True, timeout=180,
                          env=environ)


def test_the_installed_script_prints_one_line_and_exits_2():
    result = _stack("run", "--layer", "3", "--max-tokens", "0")
    assert result.returncode == 2
    _one_error_line(result.stderr, "max_tokens")


def test_stack_debug_shows_the_traceback():
    result = _stack("run", "--layer", "0", "--device", "tpu", STACK_DEBUG="1")
    assert result.returncode == 1 and "Traceback (most recent call last)" in result.stderr


def test_python_m_entry_shares_the_rule():
    result = subprocess.run([sys.executable, "-m", "layer0_hardware", "--device", "tpu"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    _one_error_line(result.stderr, "--device 'tpu'")


def test_a_bug_keeps_its_traceback(monkeypatch):
    monkeypatch.delenv("STACK_DEBUG", raising=False)
    run_command = cli._load_layer(0).run_command

    def buggy(argv: list[str]) -> int:
        raise RuntimeError("a bug in the layer")

    def mistaken(argv: list[str]) -> int:
        raise ValueError("a bad value")

    with pytest.raises(RuntimeError, match="a bug"):
        run_command(buggy, [])
    assert run_command(mistaken, []) == 2
    monkeypatch.setenv("STACK_DEBUG", "1")
    with pytest.raises(ValueError, match="a bad value"):
        run_command(mistaken, [])


@pytest.mark.parametrize("command", ["run", "bench"])
@pytest.mark.parametrize("layer", sorted(cli.built_layers()))
def test_layer_help_shows_the_layers_own_options(command, layer):
    result = runner.invoke(cli.app, [command, "--layer", str(layer), "--help"])
    assert result.exit_code == 0, result.output
    assert f"stack {command} --layer {layer}" in result.output and "--help" in result.output


def test_help_without_a_layer_is_the_commands_help():
    result = runner.invoke(cli.app, ["run", "--help"])
    assert result.exit_code == 0 and "--layer N --help" in result.output
    missing = runner.invoke(cli.app, ["run"])
    assert missing.exit_code == 2 and "needs --layer N" in missing.stderr


# ---------------------------------------------------------------- usage mistakes, every command
# click's (the `stack` group's options) and argparse's (each command's own): one line, exit 2.
USAGE_MISTAKES = [
    (["bogus"], "No such command 'bogus'"),
    (["grade", "--lab", "x"], "'--lab'"),
    (["grade"], "Missing option '--lab'"),
    (["run", "--layer", "x"], "'--layer'"),
    (["run", "--layer", "3", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["serve", "--port", "x"], "stack serve: argument --port: invalid int value: 'x'"),
    (["chat", "--port", "x"], "argument --port: invalid int value: 'x'"),
    (["chat", "--server", "http://x", "--model", "course"], "exclusive"),
    (["route", "--policy", "x"], "stack route: argument --policy: invalid choice: 'x'"),
    (["trace", "--max-tokens", "x"], "stack trace: argument --max-tokens"),
    (["models", "bogus"], "stack models"),
]


@pytest.mark.parametrize("args, says", USAGE_MISTAKES, ids=[" ".join(a) for a, _ in USAGE_MISTAKES])
def test_every_commands_usage_mistake_is_one_error_line(args, says, monkeypatch):
    monkeypatch.delenv("STACK_DEBUG", raising=False)
    result = runner.invoke(cli.app, args)
    assert result.exit_code == 2, (result.output, result.exception)
    _one_error_line(result.stderr, says)
    assert result.stdout == ""  # errors go to stderr only


def test_argparse_keeps_its_own_error_outside_the_cli():
    """The one-line rule is installed only while a `stack` command runs."""
    import argparse
    before = argparse.ArgumentParser.error
    runner.invoke(cli.app, ["serve", "--port", "x"])
    assert argparse.ArgumentParser.error is before


def test_layer_7_is_registered_like_the_others():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '7 = "layer7_app.bench.commands"' in text
    from layer7_app.bench import commands
    assert callable(commands.run) and callable(commands.bench) and commands.TITLE
    if 7 not in cli.built_layers():
        pytest.skip("the installed metadata predates layer 7's entry point (reinstall)")
    result = runner.invoke(cli.app, ["layers"])
    assert result.exit_code == 0 and result.output.splitlines()[-1].startswith("7  layer7_app")
