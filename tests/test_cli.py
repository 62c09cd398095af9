"""The `stack` CLI: discovery through entry points, errors, and the installed script."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
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
    result = runner.invoke(cli.app, ["grade", "--lab", "0", "--reference", "--submission", str(tmp_path / "x.py")])
    assert result.exit_code == 2 and "exclusive" in result.output


def test_installed_script_runs_info():
    script = shutil.which("stack") or str(__import__("pathlib").Path(sys.executable).with_name("stack"))
    result = subprocess.run([script, "info"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "CPU" in result.stdout
