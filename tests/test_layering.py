"""The one architectural rule: layer N imports only layer N-1, through its __init__.

`lint-imports` checks the contracts in pyproject.toml; the second test plants violations
in a copy of the packages and proves the check reports them.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = sorted(p.name for p in ROOT.glob("layer[0-7]_*") if p.is_dir())


def lint_imports(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    exe = Path(sys.executable).with_name("lint-imports")
    command = [str(exe) if exe.exists() else "lint-imports", "--no-cache"]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_there_are_eight_layers():
    assert [name[:6] for name in LAYERS] == [f"layer{i}" for i in range(8)]


def test_layer_rule_holds():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" not in result.stdout.split("Contracts:")[-1].split("kept")[0]


@pytest.mark.parametrize(
    ("module", "source", "contract"),
    [
        ("layer2_comm/_skip.py", "import layer0_hardware\n", "layer0_hardware is imported only by layer1_kernels"),
        ("layer0_hardware/_up.py", "import layer1_kernels\n", "layer1_kernels is imported only by layer2_comm"),
        ("layer1_kernels/_private.py", "from layer0_hardware import interpreter_secret\n", None),
        ("layer1_kernels/_deep.py", "import layer0_hardware.sub\n", "layer0_hardware is seen from outside only through its __init__"),
    ],
)
def test_layer_rule_check_can_fail(tmp_path: Path, module: str, source: str, contract: str | None):
    """Copy the packages, plant one violating module, and expect lint-imports to name it."""
    for name in LAYERS:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "layer0_hardware" / "sub.py").write_text('"""a private submodule"""\n')
    (tmp_path / module).write_text(source)

    result = lint_imports(tmp_path, pythonpath=tmp_path)
    if contract is None:  # importing a name from a layer's __init__ is allowed... when adjacent
        assert result.returncode == 0, result.stdout
        return
    assert result.returncode != 0, result.stdout
    assert f"{contract} BROKEN" in result.stdout
    assert module.replace("/", ".").removesuffix(".py") in result.stdout
