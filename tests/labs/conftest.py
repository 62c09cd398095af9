"""The grading plugin for lab tests.

- The `impl` fixture is what a lab test grades: the student's exercises.py when
  LLM_STACK_SUBMISSION names one (`stack grade`), else the layer package the test file
  names in REFERENCE (plain `pytest`, so the repo's own run grades the reference).
- `@pytest.mark.points(n)` gives a test its weight.
- With LLM_STACK_GRADE_RESULTS set, every collected test is written to that JSON file as
  pending, then rewritten as each finishes: a run cut off part-way still says what it did.
- Where test_grader.py's test_reference_earns_full_marks[N] is selected, lab N's tests are
  not also run in this process: that test runs each of them on the reference (through
  `stack grade`'s subprocess) and fails naming any that did not pass. Run alone
  (`pytest tests/labs/test_lab2.py`), a lab's tests run here as usual.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from layer7_app.grading import ENV_RESULTS, ENV_SUBMISSION

MAX_OUTPUT_CHARS = 2000
MAX_REASON_CHARS = 500

_results: dict[str, dict] = {}


def _imports_of(path: Path) -> set[str]:
    """Top-level package names a source file imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def load_submission(path: Path, reference: str) -> ModuleType:
    """Import a student's file as a fresh module. Importing the reference package itself
    would grade the answer key, so it is refused."""
    if reference.split(".")[0] in _imports_of(path):
        raise ImportError(f"{path.name} imports the reference package {reference}: write your own")
    spec = importlib.util.spec_from_file_location(f"submission_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import does: dataclasses look their module up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    return module


@pytest.fixture(scope="module")
def impl(request: pytest.FixtureRequest) -> ModuleType:
    reference = getattr(request.module, "REFERENCE", None)
    if reference is None:
        raise RuntimeError(f"{request.module.__name__} must set REFERENCE = '<layer package>'")
    submission = os.environ.get(ENV_SUBMISSION)
    if not submission:
        return importlib.import_module(reference)
    try:
        return load_submission(Path(submission), reference)
    except Exception as exc:  # a broken submission fails its tests, not the grader
        pytest.fail(f"could not import the submission {submission}: {type(exc).__name__}: {exc}")


@pytest.hookimpl(trylast=True)  # after -m/-k have deselected what they will
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    graded = {f"test_lab{item.callspec.params['lab']}" for item in items
              if getattr(item, "originalname", None) == "test_reference_earns_full_marks"}
    here = Path(__file__).parent
    twice = [item for item in items if item.path.parent == here and item.path.stem in graded]
    if twice:
        config.hook.pytest_deselected(items=twice)
        dropped = set(twice)
        items[:] = [item for item in items if item not in dropped]


def _points(item: pytest.Item) -> float:
    marker = item.get_closest_marker("points")
    return float(marker.args[0]) if marker else 1.0


def failure_output(report: pytest.TestReport) -> str:
    """Why a test failed, first line first (`stack grade` prints that line), then the tail
    of pytest's report: the message of the exception that failed it, not the file:line
    where it was raised (a fixture's pytest.fail would otherwise read "conftest.py:68")."""
    crash = getattr(report.longrepr, "reprcrash", None)
    lines = crash.message.strip().splitlines() if crash and crash.message.strip() else []
    reason = lines[0].removeprefix("Failed: ") if lines else "failed"
    reason = reason[:MAX_REASON_CHARS]
    room = MAX_OUTPUT_CHARS - len(reason) - 2
    return f"{reason}\n\n{report.longreprtext[-room:]}"


def _write_results() -> None:
    path = os.environ.get(ENV_RESULTS)
    if path:
        Path(path).write_text(json.dumps(list(_results.values()), indent=1))


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        _results[item.nodeid] = {
            "name": item.name, "score": 0.0, "max_score": _points(item),
            "status": "pending", "output": "",
        }
    _write_results()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _results.get(report.nodeid)
    if entry is None:
        return
    if report.skipped:  # e.g. a gpu test on a CPU: not graded here
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
        entry.update(status="passed", max_score=0.0, output=f"skipped, not graded here: {reason}")
    elif report.failed:
        entry.update(status="failed", score=0.0, output=failure_output(report))
    elif report.when == "call":
        entry.update(status="passed", score=entry["max_score"], output="")
    _write_results()
