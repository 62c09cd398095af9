"""Running a lab's tests in a pytest subprocess that may crash or hang, and still learning what
each test did: the crash isolation behind `stack grade` (layer7_app/grading.py).

The grading plugin (tests/labs/conftest.py) writes every test's entry to a JSON file (the
path in ENV_RESULTS): all "pending" at collection, the one under way "running" (with when it
began and its time limit), each finished one "passed" or "failed". From that file:
- a test still running HARD_STOP_GRACE_S past its limit is stuck where the limit cannot reach
  (a call into C holds the interpreter, and with it pytest-timeout's signal): the process is
  stopped and the test failed, saying so;
- a process that died (a signal: segfault, abort, kill) is pinned on the test it was in,
  named with the signal, and the tests left are run again in a fresh process.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Where the grading plugin writes its per-test results.
ENV_RESULTS = "LLM_STACK_GRADE_RESULTS"
#: How long past its time limit a test may still run before its process is stopped.
HARD_STOP_GRACE_S = 15.0
POLL_S = 0.25


class NoResults(RuntimeError):
    """The first pytest process ended without writing any result (its log's tail says why)."""


def run_isolated(cwd: Path, targets: list[str], env: dict[str, str], test_timeout: float,
                 total_timeout: float) -> dict[str, dict]:
    """Run pytest on targets (in cwd, with env) until every collected test has an outcome:
    node id -> its entry ("passed"/"failed", score, max_score, output...), in the first
    run's order. Raises NoResults if the first process wrote none."""
    deadline = time.perf_counter() + total_timeout
    entries: dict[str, dict] = {}  # node id -> its entry, in the first run's order
    env = dict(env)
    with tempfile.TemporaryDirectory(prefix="llm-stack-grade-") as tmp:
        results_file = Path(tmp) / "results.json"
        env[ENV_RESULTS] = str(results_file)
        while True:  # one pytest run, then one more per hard crash, on the tests left
            results_file.unlink(missing_ok=True)
            code, log = _run_pytest(cwd, targets, env, test_timeout, deadline, results_file)
            if not results_file.exists():
                if entries:  # a fresh process died before its first test: say so, stop
                    _fail_left(entries, f"not graded: the grading process ended before "
                                        f"this test ran ({ending(code)})")
                    break
                raise NoResults(log[-3000:])
            raw = json.loads(results_file.read_text())
            entries.update((e["nodeid"], e) for e in raw)
            if code is None:
                _fail_left(entries, f"not finished: the whole grading run exceeded "
                                    f"{total_timeout:.0f} s")
                break
            crashed = [e for e in raw if e["status"] == "running"]
            for e in crashed:  # the test the process died in
                e.update(status="failed", score=0.0, output=_crash_report(code, log))
            left = [e["nodeid"] for e in raw if e["status"] == "pending"]
            if not left:
                break
            if len(left) == len(raw):  # died before any test began: a fresh one would too
                _fail_left(entries, f"not graded: the grading process ended before this test "
                                    f"ran ({ending(code)})")
                break
            if code >= 0 and not crashed:  # pytest ended on its own with tests left
                _fail_left(entries, f"test did not run (pytest ended: {ending(code)})")
                break
            targets = left
    return entries


def _run_pytest(cwd: Path, targets: list[str], env: dict, test_timeout: float,
                deadline: float, results_file: Path) -> tuple[int | None, str]:
    """Run pytest once; (its exit code, or None if cut off at the deadline; its output).

    While it runs, the test it is in (the grading plugin marks it "running", with its start
    and time limit) is watched: one still running HARD_STOP_GRACE_S past its limit is stuck
    where the limit cannot reach (a call into C holds the interpreter, and with it the
    signal pytest-timeout sends), so the process is stopped and the test failed, saying so."""
    command = [
        sys.executable, "-m", "pytest", *targets, "-q", "-p", "no:cacheprovider",
        "-o", "addopts=", f"--timeout={test_timeout}",
    ]
    grace = float(env.get("LLM_STACK_HARD_STOP_GRACE_S", HARD_STOP_GRACE_S))
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
        code: int | None = None
        while (code := proc.poll()) is None:
            if time.perf_counter() > deadline:
                _kill(proc)
                code = None
                break
            stuck = _stuck_test(results_file, grace)
            if stuck is not None:
                _kill(proc)
                stuck.update(status="failed", score=0.0, output=(
                    f"still running {grace:g} s after its {stuck['limit']:g} s time limit, "
                    "stuck where the limit cannot interrupt it (a long call into C code or "
                    "a kernel): the grading process was stopped here; the tests after it "
                    "were graded in a fresh process"))
                _rewrite(results_file, stuck)
                code = proc.returncode
                break
            time.sleep(POLL_S)
        out.seek(0)
        return code, out.read()


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def _read(results_file: Path) -> list[dict]:
    try:
        return json.loads(results_file.read_text())
    except (OSError, ValueError):  # not written yet
        return []


def _stuck_test(results_file: Path, grace: float) -> dict | None:
    now = time.time()
    return next((e for e in _read(results_file) if e["status"] == "running"
                 and e.get("limit") and now - e["started"] > e["limit"] + grace), None)


def _rewrite(results_file: Path, entry: dict) -> None:
    entries = [entry if e["nodeid"] == entry["nodeid"] else e for e in _read(results_file)]
    results_file.write_text(json.dumps(entries))


SIGNALS = {
    "SIGSEGV": "a segmentation fault: memory read or written out of bounds (an unmasked "
               "load or store, a bad pointer)",
    "SIGBUS": "a bus error: a bad memory access",
    "SIGABRT": "an abort: C code found the process broken (heap corruption, a failed "
               "C-level assertion)",
    "SIGFPE": "an arithmetic fault (an integer division by zero in C code)",
    "SIGILL": "an illegal instruction",
    "SIGKILL": "killed: out of memory, or stopped from outside",
}


def ending(code: int | None) -> str:
    if code is None:
        return "cut off at the time limit"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + (f", {SIGNALS[name]}" if name in SIGNALS else "")
    return f"exit status {code}"


def _crash_report(code: int, log: str) -> str:
    """Why a test failed when the process died under it: the signal, then the log's tail
    (pytest's faulthandler prints the Python stack of a fatal signal there)."""
    return (f"the grading process died while this test ran ({ending(code)}); the tests "
            f"after it were graded in a fresh process\n\n{log[-1500:]}")


def _fail_left(entries: dict[str, dict], why: str) -> None:
    for e in entries.values():
        if e["status"] in ("pending", "running"):
            e.update(status="failed", score=0.0, output=why)
