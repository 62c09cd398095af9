"""The autograder must discriminate: for every lab the untouched starter earns 0 and the
reference earns full marks; for lab 0, partial work earns partial credit and a hanging
function costs its own points only."""
from __future__ import annotations

import json
import time

import pytest

from layer7_app.grading import available_labs, grade_lab, print_report

LABS = sorted(available_labs())


def test_there_is_a_lab_per_built_layer():
    assert {0, 1, 2, 3, 4, 5} <= set(LABS)


@pytest.mark.parametrize("lab", LABS)
def test_starter_earns_zero(lab):
    report = grade_lab(lab)
    assert report.max_score > 0
    assert report.score == 0, [t.name for t in report.tests if t.score]


@pytest.mark.parametrize("lab", LABS)
def test_reference_earns_full_marks(lab, tmp_path):
    report = grade_lab(lab, reference=True)
    failed = {t.name: t.output[-500:] for t in report.tests if t.status != "passed"}
    assert not failed
    assert report.score == report.max_score > 0
    body = json.loads(report.write_json(tmp_path / "results.json").read_text())
    assert body["score"] == report.score
    assert {"name", "score", "max_score", "status", "output"} <= set(body["tests"][0])


def test_partial_work_and_a_hang_are_scored_per_test(tmp_path):
    starter = available_labs()[0].exercises.read_text()
    submission = tmp_path / "exercises.py"
    submission.write_text(starter + '''

def arithmetic_intensity(flops, nbytes):
    if nbytes <= 0 or flops < 0:
        raise ValueError("nbytes must be positive and flops non-negative")
    return flops / nbytes


def ridge_point(peak_flops, bandwidth):
    while True:  # a hang: must cost this test only
        pass
''')
    start = time.perf_counter()
    report = grade_lab(0, submission=submission, test_timeout=3)
    assert time.perf_counter() - start < 60
    scores = {t.name: t for t in report.tests}
    assert scores["test_arithmetic_intensity"].status == "passed"
    assert scores["test_ridge_point"].status == "failed"
    assert "Timeout" in scores["test_ridge_point"].output
    assert report.score == scores["test_arithmetic_intensity"].max_score


def test_a_submission_that_imports_the_answers_earns_nothing(tmp_path):
    submission = tmp_path / "exercises.py"
    submission.write_text("from layer0_hardware import *\n")
    report = grade_lab(0, submission=submission)
    assert report.score == 0
    assert "imports the reference package" in report.tests[0].output


def test_a_submission_that_does_not_import_fails_cleanly(tmp_path, capsys, monkeypatch):
    submission = tmp_path / "exercises.py"
    submission.write_text("def arithmetic_intensity(:\n")
    report = grade_lab(0, submission=submission)
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
        grade_lab(0, submission=tmp_path / "nope.py")
