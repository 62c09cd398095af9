"""`stack trace`: the trace loads (valid JSON, the expected spans, one row per layer), and
the table's layer times partition the request's wall time (sum within 10%, none negative)."""
from __future__ import annotations

import json

import pytest

from layer7_app.trace import LAYERS, trace_main, trace_request

EXPECTED = {"client.request", "router.proxy", "server.http", "engine.queue", "engine.request",
            "scheduler.step", "model.forward"}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    out = tmp_path_factory.mktemp("trace") / "trace.json"
    return trace_request("ROMEO.\nWhat news?", max_tokens=6, out=out)


def test_the_trace_loads_with_every_layers_spans(traced):
    body = json.loads(traced.path.read_text())
    events = body["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    names = {e["name"] for e in spans}
    assert EXPECTED <= names, EXPECTED - names
    assert any(n.startswith("aten::") for n in names), "no kernels in the trace"
    assert {e["pid"] for e in spans} >= {8, 7, 6, 4, 3, 1}
    rows = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {LAYERS[p] for p in (8, 7, 6, 4, 3, 1)} <= rows
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    steps = [e for e in spans if e["name"] == "scheduler.step"]
    forwards = [e for e in spans if e["name"] == "model.forward"]
    assert len(steps) == traced.tokens == 6 and len(forwards) >= len(steps)
    for f in forwards:  # each forward lies inside a step (1 us of rounding allowed)
        assert any(s["ts"] - 1 <= f["ts"] and f["ts"] + f["dur"] <= s["ts"] + s["dur"] + 1
                   for s in steps)


def test_layer_times_add_up_to_the_wall_time(traced):
    total = sum(s for _, s in traced.rows)
    assert abs(total - traced.wall_s) <= 0.10 * traced.wall_s, (total, traced.wall_s)
    assert all(s >= -1e-3 for _, s in traced.rows), traced.rows  # nested spans: no negatives
    assert traced.kernels["time_s"] > 0 and traced.kernels["leaf_ops"] > traced.tokens


def test_stack_trace_user_errors_are_one_line_exit_2(capsys):
    assert trace_main(["", "--no-router"]) == 2
    assert trace_main(["x", "--max-tokens", "0"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()  # errors go to stderr, one line each
    assert out == "" and len(lines) == 2 and all(line.startswith("error: ") for line in lines), lines
