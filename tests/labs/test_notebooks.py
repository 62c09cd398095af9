"""Every lab notebook runs top to bottom on the CPU (with the reference answers, since the
starter exercises raise NotImplementedError by design)."""
from __future__ import annotations

import asyncio
import importlib.util
import os
from pathlib import Path

import pytest

from layer2_comm.launch import START_METHOD_ENV
from layer7_app.grading import available_labs

# absent on the GPU machine; CI has them. Imported by the run that needs them, not at
# collection: nbformat imports jsonschema (~3 s, every xdist worker collects this file).
NB_MISSING = [m for m in ("nbformat", "nbclient") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(NB_MISSING), reason=f"could not import {NB_MISSING}")

NOTEBOOKS = sorted(
    nb for lab in available_labs().values() for nb in lab.directory.glob("lab*.ipynb")
)
# Notebooks executed at once, each in its own kernel with its own results and cache folders
# (servers bind port 0, ranks take free ports). Much of a notebook's time is one busy thread
# (lab 4, 6, 7 set torch to one thread) or waiting on a kernel or ranks to start: two at a
# time keep a 2-core CI machine busy.
AT_ONCE = 2


def test_every_lab_has_a_notebook():
    assert {nb.parent for nb in NOTEBOOKS} == {lab.directory for lab in available_labs().values()}


def _cpu_ceilings():
    """This machine's ceilings, measured (quick) with the matmuls small (tests/small_matmuls.py):
    the notebooks' caches start with them, as a student's does after lab 0's `stack bench
    --layer 0`. Else lab 1's load_ceilings measures them in its kernel, ~10 s of CPU in emulated
    bf16 1024^3 products; load_ceilings' measuring when nothing is cached is
    test_microbench_ceilings'."""
    from layer0_hardware import measure_ceilings
    from tests.small_matmuls import patch_small_matmuls

    with pytest.MonkeyPatch.context() as mp:
        patch_small_matmuls(mp)
        return measure_ceilings("cpu", quick=True, progress=False)


async def _execute(notebook: Path, tmp: Path, ceilings) -> list[dict]:
    """Run one notebook; returns the error outputs of its cells (nbclient raises on most)."""
    import nbformat
    from nbclient import NotebookClient

    from layer0_hardware import ceilings_path, save_ceilings

    env = {**os.environ, "LLM_STACK_LAB_REFERENCE": "1",  # the notebook imports the answers
           "LLM_STACK_RESULTS": str(tmp / "results"), "LLM_STACK_CACHE": str(tmp / "cache"),
           "MPLBACKEND": "Agg",
           # labs 2 and 5 launch ranks many times: forked from a server that imported torch
           # once, as the grader's are, not each importing it (what a student's run does)
           START_METHOD_ENV: "forkserver"}
    with pytest.MonkeyPatch.context() as mp:  # (ceilings_path reads the variable)
        mp.setenv("LLM_STACK_CACHE", env["LLM_STACK_CACHE"])
        save_ceilings(ceilings, ceilings_path(ceilings.device_name))
    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(notebook.parent)}})
    await client.async_execute(env=env)
    return [o for cell in nb.cells for o in cell.get("outputs", [])
            if o.get("output_type") == "error"]


@pytest.fixture(scope="module")
def executed(request: pytest.FixtureRequest, tmp_path_factory) -> dict:
    """The selected notebooks, run AT_ONCE at a time when the first of their tests starts:
    notebook -> its error outputs, or the exception its run raised."""
    wanted = [item.callspec.params["notebook"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_notebook_runs_top_to_bottom"]

    ceilings = _cpu_ceilings() if wanted else None

    async def run_all() -> list:
        gate = asyncio.Semaphore(AT_ONCE)

        async def one(notebook: Path):
            async with gate:
                return await _execute(notebook, tmp_path_factory.mktemp(notebook.stem),
                                      ceilings)

        return await asyncio.gather(*(one(nb) for nb in wanted), return_exceptions=True)

    return dict(zip(wanted, asyncio.run(run_all()), strict=True))


@pytest.mark.timeout(1200)  # the first test waits for every selected notebook
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(notebook: Path, executed: dict):
    outcome = executed[notebook]
    if isinstance(outcome, BaseException):
        raise outcome
    assert not outcome
