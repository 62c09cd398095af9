"""Layer 6 command line: `stack serve` options and errors, and the layer's entry point."""
from __future__ import annotations

from importlib.metadata import entry_points

import pytest

import layer6_serving as l6


def test_serve_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as e:
        l6.serve_main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--model", "--host", "--port", "--tp", "--api-key"):
        assert opt in out


def test_serve_with_a_missing_model_fails_cleanly(tmp_path, capsys):
    assert l6.serve_main(["--model", str(tmp_path / "nope"), "--port", "0"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and out == ""


def test_layer_6_is_registered_for_the_cli():
    eps = {ep.name: ep.value for ep in entry_points(group="llm_stack.layers")}
    assert eps.get("6") == "layer6_serving.bench.commands"


def test_grafana_dashboard_uses_only_exported_metrics():
    import json
    import re
    from pathlib import Path

    from layer6_serving.metrics import ServingMetrics

    dash = json.loads((Path(l6.__file__).parent / "grafana.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"llm_stack:\w+", e)}
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}
    exported = {f.name + x for f in ServingMetrics().registry.collect() for x in suffixes[f.type]}
    assert used and used <= exported, used - exported


@pytest.mark.slow
def test_stack_run_layer_6_drives_a_server_end_to_end(capsys):
    from importlib import import_module

    commands = import_module(entry_points(group="llm_stack.layers")["6"].value)
    assert commands.run(["--concurrency", "4", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "one stream" in out and "4/4" in out and "KV blocks used 0" in out
