"""The autograder behind `stack grade`: run a lab's pytest file on a submission, in a
separate process with timeouts, and collect a Gradescope-style report.

A lab is three files (see labs/README.md): `labs/labN_<name>/exercises.py` (the student's
work), `labs/labN_<name>/labN.ipynb` (the teaching notebook) and `tests/labs/test_labN.py`
(the graded tests, with `@pytest.mark.points(n)`). The grading plugin in
`tests/labs/conftest.py` loads the submission (or, with none named, the reference the
test file names as REFERENCE: the layer package, or the lab's answer key labN_reference.py)
and writes each test's outcome to a JSON file that isolated_pytest.py reads back, so a
submission that crashes or hangs pytest loses points for the tests it broke, never the
report: after a hard crash (a signal: segfault, abort, kill) the test that was running is
named with the signal, and the tests after it are graded in a fresh process. A test skipped
here (a GPU test on a CPU) is reported "not graded here" and counts neither way: the score
is out of what was graded.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .isolated_pytest import ENV_RESULTS as ENV_RESULTS  # the plugin's results file, re-exported
from .isolated_pytest import NoResults, run_isolated

#: Path of the submission file the grading plugin loads (unset: grade the reference).
ENV_SUBMISSION = "LLM_STACK_SUBMISSION"


@dataclass
class TestResult:
    """One graded test, in Gradescope's field names."""

    name: str
    score: float
    max_score: float
    status: str  # "passed" | "failed"
    output: str = ""
    #: {"not_graded": why, "points": n} for a test this machine cannot grade (e.g. no GPU)
    extra_data: dict = field(default_factory=dict)


@dataclass
class GradeReport:
    """What one grading run found."""

    lab: int
    graded: str  # what was graded: a file path or "reference (<package>)"
    tests: list[TestResult] = field(default_factory=list)
    execution_time: float = 0.0

    @property
    def score(self) -> float:
        return sum(t.score for t in self.tests)

    @property
    def max_score(self) -> float:
        return sum(t.max_score for t in self.tests)

    @property
    def not_graded(self) -> list[TestResult]:
        """Tests this machine could not grade (a GPU test without a GPU): out of the score."""
        return [t for t in self.tests if t.extra_data.get("not_graded")]

    def summary(self) -> str:
        """"Score: 90 / 90", and what was not graded here, if anything."""
        line = f"Score: {self.score:g} / {self.max_score:g}"
        if self.not_graded:
            points = sum(t.extra_data.get("points", 0) for t in self.not_graded)
            why = sorted({t.extra_data["not_graded"] for t in self.not_graded})
            line += (f" (out of what was graded here: {len(self.not_graded)} test(s), "
                     f"{points:g} points, not graded here: {'; '.join(why)})")
        return line

    def to_gradescope(self) -> dict:
        """The results.json body Gradescope reads (score, tests[...])."""
        return {
            "score": self.score,
            "max_score": self.max_score,
            "execution_time": round(self.execution_time, 2),
            "output": f"Lab {self.lab}: graded {self.graded}. {self.summary()}",
            "tests": [asdict(t) for t in self.tests],
        }

    def write_json(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_gradescope(), indent=2))
        return path


@dataclass(frozen=True)
class Lab:
    """Where one lab's files are."""

    number: int
    directory: Path  # labs/labN_<name>/
    test_file: Path  # tests/labs/test_labN.py

    @property
    def exercises(self) -> Path:
        return self.directory / "exercises.py"


def repo_root() -> Path:
    """The checkout holding labs/ and tests/labs/: the current directory or a parent,
    else the one this package was installed from (editable install)."""
    here = Path.cwd().resolve()
    for candidate in (here, *here.parents, Path(__file__).resolve().parents[1]):
        if (candidate / "tests" / "labs").is_dir() and (candidate / "labs").is_dir():
            return candidate
    raise FileNotFoundError(
        "cannot find the labs: run `stack grade` inside an llm-stack checkout "
        "(a directory with labs/ and tests/labs/)"
    )


def available_labs(root: Path | None = None) -> dict[int, Lab]:
    """Every lab that has both a directory and a graded test file."""
    root = root or repo_root()
    labs = {}
    for directory in sorted((root / "labs").glob("lab*_*")):
        match = re.fullmatch(r"lab(\d+)_\w+", directory.name)
        test_file = root / "tests" / "labs" / f"test_lab{match.group(1)}.py" if match else None
        if match and test_file.is_file():
            labs[int(match.group(1))] = Lab(int(match.group(1)), directory, test_file)
    return labs


def find_lab(number: int, root: Path | None = None) -> Lab:
    labs = available_labs(root)
    if number not in labs:
        listing = ", ".join(str(n) for n in sorted(labs)) or "none"
        raise ValueError(f"lab {number} does not exist; available labs: {listing}")
    return labs[number]


def grade_lab(
    number: int,
    submission: Path | None = None,
    *,
    reference: bool = False,
    test_timeout: float = 30.0,
    total_timeout: float = 900.0,
    root: Path | None = None,
    select: str | None = None,
    env: dict[str, str] | None = None,
) -> GradeReport:
    """Grade lab `number`.

    submission: the exercises.py to grade; default the lab's working file.
    reference:  grade the reference instead (what plain `pytest` does).
    test_timeout: seconds one test may take (pytest-timeout); total_timeout: the whole run.
    select: only the tests pytest's `-k` expression selects (default: all).
    env: variables to set for this run, over this process's environment.
    """
    lab = find_lab(number, root)
    env = {**os.environ, **(env or {})}
    env.pop(ENV_SUBMISSION, None)
    if reference:
        graded = "the reference implementation"
    else:
        path = Path(submission or lab.exercises).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"submission {path} does not exist")
        env[ENV_SUBMISSION] = graded = str(path)

    start = time.perf_counter()
    targets = [str(lab.test_file)] + (["-k", select] if select else [])
    try:
        entries = run_isolated(lab.test_file.parents[2], targets, env, test_timeout,
                               total_timeout)
    except NoResults as exc:
        raise RuntimeError(f"the grader could not run lab {number}'s tests:\n{exc}") from None
    elapsed = time.perf_counter() - start
    tests = []
    for entry in entries.values():
        for key in ("nodeid", "started", "limit"):
            entry.pop(key, None)
        tests.append(TestResult(**entry))
    return GradeReport(number, graded, tests, elapsed)


def reason(test: TestResult) -> str:
    """One line on why a test lost points: the first line of its output (the grading plugin
    puts the failure's message there, the traceback after it)."""
    text = test.output.strip()
    return text.splitlines()[0] if text else ""


def print_report(report: GradeReport) -> None:
    """Each test's score and status, its full name, and under a failed one why it failed;
    then the total. Nothing is cut at any terminal width (80 columns included): a long name
    or reason wraps, and a reason shared with the test above is written once."""
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"Lab {report.lab} — {report.graded}", box=box.SIMPLE_HEAD,
                  title_justify="left")
    table.add_column("score", justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("test (and why it failed)", overflow="fold")
    previous = None
    for t in report.tests:
        colour = "green" if t.status == "passed" else "red"
        why = reason(t) if t.status != "passed" or t.max_score == 0 else ""
        if t.extra_data.get("not_graded"):
            colour, t_status = "yellow", "not graded"
        else:
            t_status = t.status
        cell = escape(t.name)
        if why:
            cell += "\n[dim]" + ("(as above)" if why == previous else escape(why)) + "[/dim]"
        previous = why
        score = f"-/{t.extra_data.get('points', 0):g}" if t_status == "not graded" else \
            f"{t.score:g}/{t.max_score:g}"
        table.add_row(score, f"[{colour}]{t_status}", cell)
    console = Console()
    console.print(table)
    console.print(f"[bold]{escape(report.summary())}[/bold]")
