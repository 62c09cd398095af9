"""The grading plugin for lab tests.

- The `impl` fixture is what a lab test grades: the student's exercises.py when
  LLM_STACK_SUBMISSION names one (`stack grade`), else what the test file names in
  REFERENCE (plain `pytest`, so the repo's own run grades the reference): the layer package,
  or the lab's answer key labN_reference.py (references.py).
  A submission is loaded behind the import guard (submission_guard.py): from then on the
  layer packages and the grader's files are out of its code's reach, however it asks.
- `@pytest.mark.points(n)` gives a test its weight.
- With LLM_STACK_GRADE_RESULTS set, every collected test is written to that JSON file as
  pending, then rewritten as each finishes: a run cut off part-way still says what it did.
- Where test_grader.py's test_reference_earns_full_marks[N] is selected, lab N's tests are
  not also run in this process: that test runs each of them on the reference (through
  `stack grade`'s subprocess) and fails naming any that did not pass. Run alone
  (`pytest tests/labs/test_lab2.py`), a lab's tests run here as usual.
"""
from __future__ import annotations

import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest

from layer7_app.grading import ENV_RESULTS, ENV_SUBMISSION

from . import submission_guard
from .references import import_reference

MAX_OUTPUT_CHARS = 2000
MAX_REASON_CHARS = 500

_results: dict[str, dict] = {}


@pytest.fixture(scope="module")
def impl(request: pytest.FixtureRequest) -> ModuleType:
    reference = getattr(request.module, "REFERENCE", None)
    if reference is None:
        raise RuntimeError(f"{request.module.__name__} must set REFERENCE = '<layer package>' "
                           "or 'labN_reference'")
    submission = os.environ.get(ENV_SUBMISSION)
    if not submission:
        return import_reference(reference)
    try:
        return submission_guard.load_submission(submission)
    except Exception as exc:  # a broken submission fails its tests, not the grader
        pytest.fail(f"could not import the submission {submission}: {type(exc).__name__}: {exc}")


@pytest.fixture
def seeded() -> tuple[int, random.Random]:
    """A seed drawn afresh for this test (fresh inputs every run: an answer must be right for
    any input; the test names the seed in its failures, so one can be replayed) and the
    random.Random it seeds."""
    seed = random.SystemRandom().randrange(2**31)
    return seed, random.Random(seed)


#: grade_lab() runs at once in pooled_gradings: each is a pytest subprocess, mostly one busy
#: thread (or ranks waiting to start), its tests keeping their own per-test limits.
GRADINGS_AT_ONCE = 2
#: Plugins a grading subprocess needs: pytest-timeout only. Not autoloading the rest
#: (hypothesis, schemathesis, anyio, benchmark: ~2 s of imports) saves that.
#: Ranks (labs 2 and 5) forked from a server that imported torch once per grading, not each
#: importing it (lab 2's grading starts 24 ranks: ~45 s of CPU spent importing torch).
LEAN_GRADING_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTEST_PLUGINS": "pytest_timeout",
                    "LLM_STACK_LAUNCH_START_METHOD": "forkserver"}


@pytest.fixture(scope="session")
def pooled_gradings(request: pytest.FixtureRequest,
                    tmp_path_factory: pytest.TempPathFactory) -> Gradings:
    """Every grade_lab() run the selected tests want, pooled (see Gradings). A test module says
    what it wants through `grading_job(item, tmp_path_factory)`: None, or (key, order, run)."""
    return Gradings(request.session.items, tmp_path_factory)


class Gradings:
    """key -> the GradeReport, or the exception grade_lab raised. The first key asked for
    runs every grading its test module wants, in one pool, longest first, so short runs fill
    the time long ones leave (ranks starting, a planted hang's budget running out). By module,
    not all at once: under pytest-xdist every worker collects every test, and two workers
    given one of test_grader.py / test_planted.py each would otherwise both run all of them."""

    def __init__(self, items: list[pytest.Item], tmp_path_factory: pytest.TempPathFactory):
        self._jobs: dict = {}  # module -> {key: job}
        for item in items:
            make = getattr(getattr(item, "module", None), "grading_job", None)
            job = make(item, tmp_path_factory) if make else None
            if job is not None:
                self._jobs.setdefault(item.module.__name__, {}).setdefault(job[0], job)
        self._done: dict = {}

    def __getitem__(self, key):
        if key not in self._done:
            module = next(m for m, jobs in self._jobs.items() if key in jobs)
            self._done.update(self._run(sorted(self._jobs.pop(module).values(),
                                               key=lambda job: job[1])))
        return self._done[key]

    @staticmethod
    def _run(ordered: list) -> dict:
        def run(job):
            try:
                return job[2]()
            except Exception as exc:  # reported by the test that wanted this run
                return exc

        with pytest.MonkeyPatch.context() as mp, ThreadPoolExecutor(GRADINGS_AT_ONCE) as pool:
            for name, value in LEAN_GRADING_ENV.items():
                mp.setenv(name, value)
            return dict(zip([job[0] for job in ordered], pool.map(run, ordered), strict=True))


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


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    submission_guard.checkpoint()  # hide again what the grader's imports put back


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    submission_guard.checkpoint()


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
    if path:  # whole or not at all: the process may die at any moment (grade_lab reads it)
        part = Path(f"{path}.part")
        part.write_text(json.dumps(list(_results.values()), indent=1))
        os.replace(part, path)


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        _results[item.nodeid] = {
            "nodeid": item.nodeid, "name": item.name, "score": 0.0,
            "max_score": _points(item), "status": "pending", "output": "",
        }
    _write_results()


def _time_limit(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker and marker.args:
        return float(marker.args[0])
    return float(item.config.getoption("timeout", None) or 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """Marks the test "running", with when it began and its time limit: a process that dies
    under it is pinned on it, and grade_lab stops one stuck past the limit (a call into C
    holds the interpreter, so nothing in this process could)."""
    entry = _results.get(item.nodeid)
    if entry is not None:
        entry.update(status="running", started=time.time(), limit=_time_limit(item))
        _write_results()
    yield
    if entry is not None and entry["status"] == "running":  # ended without a report
        entry["status"] = "pending"
        _write_results()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _results.get(report.nodeid)
    if entry is None:
        return
    if report.skipped:  # e.g. a gpu test on a CPU: not graded here, out of the score
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
        reason = reason.removeprefix("Skipped: ")
        why = "needs a GPU" if "gpu" in report.keywords else reason
        entry.update(status="passed", score=0.0, max_score=0.0,
                     output=f"not graded here ({why}): {reason}",
                     extra_data={"not_graded": why, "points": entry["max_score"] or
                                 entry.get("extra_data", {}).get("points", 0)})
    elif report.failed:
        entry.update(status="failed", score=0.0, output=failure_output(report))
    elif report.when == "call":
        entry.update(status="passed", score=entry["max_score"], output="")
    _write_results()
