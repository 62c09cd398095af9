"""The autograder must discriminate: for every lab the untouched starter earns 0 and the
reference earns full marks (what a machine cannot grade, e.g. a GPU test on a CPU, says so and
counts neither way); for lab 0, partial work earns partial credit, and a hang or a crash
(signal, or a call stuck in C) costs its own test only. Planted wrong submissions:
test_planted.py."""
from __future__ import annotations

import importlib
import importlib.util
import json

import pytest

from layer7_app.grading import available_labs, grade_lab, print_report, reason

from .conftest import LEAN_GRADING_ENV

LABS = sorted(available_labs())


@pytest.fixture(autouse=True)
def lean_grading_runs(monkeypatch):
    for name, value in LEAN_GRADING_ENV.items():  # the gradings run here directly, too
        monkeypatch.setenv(name, value)


GRADED = {"test_starter_earns_zero": "starter", "test_reference_earns_full_marks": "reference"}


def grading_job(item: pytest.Item, tmp_path_factory):
    """The gradings these tests want, for conftest's pooled_gradings: lab 2's first (the
    longest: ranks), then the crashing submission and the references, then the starters."""
    name = getattr(item, "originalname", None)
    if name == "test_partial_work_hangs_and_crashes_are_scored_per_test":
        return ("crashing", 0), (True, False, -1), lambda: _grade_crashing(tmp_path_factory)
    what = GRADED.get(name)
    if what is None:
        return None
    lab = item.callspec.params["lab"]
    return ((what, lab), (lab != 2, what == "starter", lab),
            lambda: grade_lab(lab, reference=what == "reference"))


def _report(gradings: dict, what: str, lab: int):
    outcome = gradings[what, lab]
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def test_there_is_a_lab_per_built_layer():
    assert {0, 1, 2, 3, 4, 5, 6, 7} <= set(LABS)


@pytest.mark.timeout(1800)  # the first of these tests waits for every selected grading
@pytest.mark.parametrize("lab", LABS)
def test_starter_earns_zero(lab, pooled_gradings):
    report = _report(pooled_gradings, "starter", lab)
    assert report.max_score > 0
    assert report.score == 0, [t.name for t in report.tests if t.score]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("lab", LABS)
def test_reference_earns_full_marks(lab, tmp_path, pooled_gradings):
    """Also the suite's one run of lab N's tests on the reference (tests/labs/conftest.py
    leaves them out of this process when this test is selected): any that fails is named."""
    report = _report(pooled_gradings, "reference", lab)
    failed = {t.name: f"{reason(t)}\n...{t.output[-1500:]}" for t in report.tests
              if t.status != "passed"}
    assert not failed, "\n\n".join(f"{name}: {why}" for name, why in failed.items())
    assert report.score == report.max_score > 0
    for test in report.not_graded:  # what this machine cannot grade says so, counts neither way
        assert test.score == test.max_score == 0 and test.output.startswith("not graded here")
    if lab == 1 and not _has_gpu():
        assert "test_sgemm_runs_on_gpu" in {t.name for t in report.not_graded}
        assert "needs a GPU" in report.summary()
    body = json.loads(report.write_json(tmp_path / "results.json").read_text())
    assert body["score"] == report.score
    assert {"name", "score", "max_score", "status", "output"} <= set(body["tests"][0])


#: A lab-0 submission with partial work, a hang, a segfault, an abort and a call stuck in C.
CRASHING = '''

def arithmetic_intensity(flops, nbytes):
    if nbytes <= 0 or flops < 0:
        raise ValueError("nbytes must be positive and flops non-negative")
    return flops / nbytes


def ridge_point(peak_flops, bandwidth):
    while True:  # a hang: the time limit stops it, in the same process
        pass


def attainable_flops(intensity, peak_flops, bandwidth):
    import ctypes
    return ctypes.string_at(0)  # reads address 0: SIGSEGV


def classify_bound(intensity, peak_flops, bandwidth):
    import os
    os.abort()  # SIGABRT, as a C library does on heap corruption


def vector_add_cost(n, dtype_bytes=4):
    return sum(range(10**15))  # one C call: the time limit's signal waits for it to return


def matmul_cost(m, n, k, dtype_bytes=2):
    return 2.0 * m * n * k, float(dtype_bytes * (m * k + k * n + m * n))
'''


def _grade_crashing(tmp_path_factory) -> object:
    submission = tmp_path_factory.mktemp("crashing") / "exercises.py"
    submission.write_text(available_labs()[0].exercises.read_text() + CRASHING)
    return grade_lab(0, submission=submission, test_timeout=3,
                     env={"LLM_STACK_HARD_STOP_GRACE_S": "2"})


@pytest.mark.timeout(1800)
def test_partial_work_hangs_and_crashes_are_scored_per_test(pooled_gradings):
    """Right answers earn their points; a hang, a segfault, an abort and a call stuck in C
    past its time limit each cost their own test only, named with what happened, and every
    test after them is still graded (in a fresh process after each crash)."""
    report = _report(pooled_gradings, "crashing", 0)
    assert report.execution_time < 180
    tests = {t.name: t for t in report.tests}
    assert tests["test_arithmetic_intensity"].status == "passed"
    assert "Timeout" in tests["test_ridge_point"].output
    assert "SIGSEGV" in reason(tests["test_attainable_flops_is_the_roofline"])
    assert "SIGABRT" in reason(tests["test_classify_bound"])
    assert "time limit" in reason(tests["test_vector_add_cost"])
    assert tests["test_matmul_cost"].status == "passed"  # graded after three crashes
    for name in ("test_attention_decode_cost", "test_median_time_warms_up_and_ignores_outliers"):
        assert "NotImplementedError" in tests[name].output  # graded, not "did not run"
    assert report.score == tests["test_arithmetic_intensity"].max_score + \
        tests["test_matmul_cost"].max_score


# Lab 7's grading needs no torch (under a second of imports): the tests below that only need
# some lab use it.
def test_a_submission_that_imports_the_answers_earns_nothing(tmp_path):
    submission = tmp_path / "exercises.py"
    submission.write_text("from lab7_reference import *\n")
    report = grade_lab(7, submission=submission)
    assert report.score == 0
    assert "the grader refuses `lab7_reference`" in report.tests[0].output


def test_a_submission_that_does_not_import_fails_cleanly(tmp_path, capsys, monkeypatch):
    submission = tmp_path / "exercises.py"
    submission.write_text("def prefix_key(:\n")
    report = grade_lab(7, submission=submission)
    assert report.score == 0 and "SyntaxError" in report.tests[0].output
    # The terminal says why (not "conftest.py:68: Failed"), and cuts no name at 80 columns.
    monkeypatch.setenv("COLUMNS", "80")
    print_report(report)
    printed = capsys.readouterr().out
    assert "could not import the submission" in printed and "SyntaxError" in printed
    assert "conftest.py" not in printed
    assert all(len(line) <= 80 for line in printed.splitlines())
    for test in report.tests:
        assert test.name in printed


def test_missing_submission_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        grade_lab(7, submission=tmp_path / "nope.py")


def _load_grader(lab: int):
    """A lab's grader module, imported under the name pytest gives it beside this file:
    spawned ranks import `rank_checks` from it by that name."""
    package = __name__.rpartition(".")[0]  # "tests.labs", or "" where tests/ is no package
    return importlib.import_module(f"{package}.test_lab{lab}" if package else f"test_lab{lab}")


def test_a_deadlock_in_lab2_is_caught_by_the_per_call_watchdog(tmp_path, monkeypatch):
    """Lab 2 times each graded call (not the ranks' start-up, which a loaded machine slows):
    a submission whose ranks all wait in recv is stopped after the call limit and told why."""
    grader = _load_grader(2)
    monkeypatch.setenv(grader.CALL_LIMIT_ENV, "3")  # not the default 20 s: the same watchdog
    submission = tmp_path / "exercises.py"
    submission.write_text(available_labs()[2].exercises.read_text() + '''

def ring_all_reduce(tensor, op="sum"):
    import torch.distributed as dist
    p, r = dist.get_world_size(), dist.get_rank()
    dist.recv(torch.empty_like(tensor), (r - 1) % p)  # every rank waits first
    dist.send(tensor, (r + 1) % p)
    return tensor
''')
    spec = importlib.util.spec_from_file_location("deadlocked_submission", submission)
    impl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(impl)
    with pytest.raises(pytest.fail.Exception) as failed:
        grader.run_ranks(impl, "ring_all_reduce", 2)
    first_line = str(failed.value).splitlines()[0]
    assert "did not return within 3 s" in first_line and "deadlock" in first_line
    assert "ring_all_reduce(a float32 tensor" in first_line  # the case the ranks were in
