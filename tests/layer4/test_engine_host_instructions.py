"""benchmarks/engine_host_instructions.py: the collection switch (callgrind's toggle) follows
phases and excluded calls, and the script's workload runs (without valgrind) and leaves the
engine's classes as they were."""
from __future__ import annotations

from tests.benchmark_script import load


class Toggles:
    def __init__(self) -> None:
        self.n = 0

    def cg_toggle(self) -> None:
        self.n += 1


def test_collection_follows_the_phase_and_stops_inside_excluded_calls():
    hi = load("engine_host_instructions")
    cg = Toggles()
    col = hi.Collector(cg)
    seen = []
    inner = col.exclude(lambda: seen.append(("inner", col.on)))
    outer = col.phase("p", lambda: (seen.append(("outer", col.on)), inner(),
                                    seen.append(("after", col.on))))
    col.armed, col.target = True, "p"
    col.sync()
    assert not col.on  # armed, but outside the phase
    outer()
    assert seen == [("outer", True), ("inner", False), ("after", True)] and not col.on
    assert cg.n == 4  # on, off (excluded), on, off
    col.target = None  # the whole step: on everywhere but excluded calls
    col.sync()
    assert col.on
    col.armed = False
    col.sync()
    assert not col.on and cg.n == 6


def test_dry_run_leaves_the_engine_as_it_was():
    import torch

    from layer4_algorithms import engine, launched_step, scheduler
    before = (scheduler.Scheduler.schedule, engine.LLM._complete,
              vars(launched_step.LaunchedStep)["on_device"], torch.Tensor.argmax)
    hi = load("engine_host_instructions")
    hi.main(["--dry", "--seqs", "6", "--steps", "2"])
    hi.main(["--dry", "--fine", "--seqs", "4", "--steps", "1"])
    hi.main(["--dry", "--prefill", "200", "--steps", "1"])  # (the prefill calls' phases)
    assert (scheduler.Scheduler.schedule, engine.LLM._complete,
            vars(launched_step.LaunchedStep)["on_device"], torch.Tensor.argmax) == before
