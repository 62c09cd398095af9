"""bench/pp_phases.py on the CPU: rank 0's decode steps by phase, one engine and PP=2 with two
steps in flight (gloo), the pipeline's own phases named, the same greedy tokens."""
from __future__ import annotations

import json

from layer5_parallel.bench import pp_phases


def test_pp_phases_names_the_pipeline_parts(tmp_path, capsys):
    out = tmp_path / "pp.json"
    assert pp_phases.main(["--layouts", "1,pp2gf", "--seqs", "6", "--prompt", "5",
                           "--new-tokens", "5", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "same tokens as 1: True" in text.split("pp2gf:")[1], text
    rows = json.loads(out.read_text())["rows"]
    assert [r["layout"] for r in rows] == ["1", "pp2gf"]
    one, pp = (r["phases"]["phases"] for r in rows)
    assert "dispatch" not in one and "schedule" in one
    for phase in ("dispatch", "collect", "hand-off send", "hand-off recv", "stage graph",
                  "ring put"):
        assert phase in pp, (phase, sorted(pp))
    assert "step broadcast" not in pp  # one rank a stage: the table rides in the message
    assert rows[1]["steps"] > rows[0]["steps"]  # two lanes: a lane step each
