"""benchmarks/engine_host_time.py --timeline: a lone prefill's stamps come in the order the
engine calls its methods, both clocks fill every row, and the engine's classes (and gc) are
left as they were."""
from __future__ import annotations

import gc
import math

from tests.benchmark_script import load


def test_timeline_rows_follow_the_call_and_leave_the_engine_as_it_was():
    ht = load("engine_host_time")
    before = {(cls, attr): (getattr(cls, attr) if cls is gc else vars(
        next(c for c in cls.__mro__ if attr in vars(c)))[attr]) for cls, attr in ht.TIMELINE}
    callbacks = list(gc.callbacks)
    rows = ht.prefill_timeline(64, 2)
    assert gc.callbacks == callbacks
    labels = [label for _, _, label in rows]
    order = ["LLM.generate in", "LLM.add_request out", "Scheduler.schedule in",
             "replay (stub)", "LLM._sample_launch out", "LLM._outputs out#2",
             "gc.unfreeze out", "LLM.generate out", "the caller's next line"]
    assert all(label in labels for label in order), labels
    assert [labels.index(label) for label in order] == sorted(labels.index(x) for x in order)
    assert all(not math.isnan(w) and not math.isnan(c) for w, c, _ in rows)
    assert rows[-1][2] == "the caller's next line"
    after = {(cls, attr): (getattr(cls, attr) if cls is gc else vars(
        next(c for c in cls.__mro__ if attr in vars(c)))[attr]) for cls, attr in ht.TIMELINE}
    assert after == before
