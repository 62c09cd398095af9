"""The autograder behind `stack grade`: run a lab's pytest file on a submission, in a
separate process with timeouts, and collect a Gradescope-style report.

A lab is three files (see labs/README.md): `labs/labN_<name>/exercises.py` (the student's
work), `labs/labN_<name>/labN.ipynb` (the teaching notebook) and `tests/labs/test_labN.py`
(the graded tests, with `@pytest.mark.points(n)`). The grading plugin in
`tests/labs/conftest.py` loads the submission (or, with none named, the layer package
the test file names as REFERENCE) and writes each test's outcome to a JSON file that
this module reads back, so a submission that crashes or hangs pytest loses points for
the tests it broke, never the report.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: Path of the submission file the grading plugin loads (unset: grade the reference).
ENV_SUBMISSION = "LLM_STACK_SUBMISSION"
#: Where the grading plugin writes its per-test results.
ENV_RESULTS = "LLM_STACK_GRADE_RESULTS"


@dataclass
class TestResult:
    """One graded test, in Gradescope's field names."""

    name: str
    score: float
    max_score: float
    status: str  # "passed" | "failed"
    output: str = ""


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

    def to_gradescope(self) -> dict:
        """The results.json body Gradescope reads (score, tests[...])."""
        return {
            "score": self.score,
            "max_score": self.max_score,
            "execution_time": round(self.execution_time, 2),
            "output": f"Lab {self.lab}: graded {self.graded}",
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
) -> GradeReport:
    """Grade lab `number`.

    submission: the exercises.py to grade; default the lab's working file.
    reference:  grade the layer package instead (what plain `pytest` does).
    test_timeout: seconds one test may take (pytest-timeout); total_timeout: the whole run.
    """
    lab = find_lab(number, root)
    env = dict(os.environ)
    env.pop(ENV_SUBMISSION, None)
    if reference:
        graded = "the reference implementation"
    else:
        path = Path(submission or lab.exercises).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"submission {path} does not exist")
        env[ENV_SUBMISSION] = graded = str(path)

    with tempfile.TemporaryDirectory(prefix="llm-stack-grade-") as tmp:
        results_file = Path(tmp) / "results.json"
        env[ENV_RESULTS] = str(results_file)
        command = [
            sys.executable, "-m", "pytest", str(lab.test_file), "-q", "-p", "no:cacheprovider",
            "-o", "addopts=", f"--timeout={test_timeout}",
        ]
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                command, cwd=lab.test_file.parents[2], env=env, capture_output=True,
                text=True, timeout=total_timeout, stdin=subprocess.DEVNULL,
            )
            stopped, log = None, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            stopped = f"not finished: the whole grading run exceeded {total_timeout:.0f} s"
            log = str(exc.stdout or "")
        elapsed = time.perf_counter() - start
        if not results_file.exists():
            raise RuntimeError(f"the grader could not run lab {number}'s tests:\n{log[-3000:]}")
        raw = json.loads(results_file.read_text())

    tests = []
    for entry in raw:
        if entry["status"] == "pending":  # collected but never reported: the run was cut off
            entry.update(status="failed", score=0, output=stopped or "test did not run")
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
        cell = escape(t.name)
        if why:
            cell += "\n[dim]" + ("(as above)" if why == previous else escape(why)) + "[/dim]"
        previous = why
        table.add_row(f"{t.score:g}/{t.max_score:g}", f"[{colour}]{t.status}", cell)
    console = Console()
    console.print(table)
    console.print(f"[bold]Score: {report.score:g} / {report.max_score:g}[/bold]")
