"""bench/pp_phases.py on the CPU: rank 0's decode steps by phase, one engine and PP=2 with two
steps in flight (gloo), the pipeline's own phases named, the same greedy tokens."""
from __future__ import annotations

import json

from layer5_parallel.bench import pp_phases


def test_pp_phases_names_the_pipeline_parts(tmp_path, capsys):
    out = tmp_path / "pp.json"
    assert pp_phases.main(["--layouts", "1,pp2gf,pp2gs", "--seqs", "6,3", "--prompt", "5",
                           "--new-tokens", "5", "--prefill-first", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tokens: same as 1" in text.split("pp2gf @ 6 seqs:")[1], text
    assert "tokens: same as 1; same as pp2gf" in text.split("pp2gs @ 3 seqs:")[1], text
    rows = json.loads(out.read_text())["rows"]
    assert [(r["layout"], r["seqs"]) for r in rows] == [
        ("1", 3), ("1", 6), ("pp2gf", 3), ("pp2gf", 6), ("pp2gs", 3), ("pp2gs", 6)]
    assert all(r["decode_steps"] > 0 and r["decode_tok_s"] > 0 for r in rows)
    assert rows[0]["vs_base"] == 1.0 and rows[3]["vs"]["1"]["same_tokens"]
    one, pp = (r["phases"]["phases"] for r in (rows[1], rows[3]))
    assert "dispatch" not in one and "schedule" in one
    for phase in ("dispatch", "collect", "hand-off send", "hand-off recv", "stage graph",
                  "ring put"):
        assert phase in pp, (phase, sorted(pp))
    assert "step broadcast" not in pp  # one rank a stage: the table rides in the message
    assert rows[3]["steps"] > rows[1]["steps"]  # two lanes: a lane step each


def test_pp2_floor_counts_weights_against_the_cache():
    """The 8B shape: 7.5e9 weights read a step in bf16 (32 layers of 218M, the 525M LM head),
    128 KiB of KV a token; no cache: no gain; a cache as big as the weights: 4/3."""
    import layer4_algorithms as engine
    from layer5_parallel.bench.tp_gpu_bench import SHAPES

    config = engine.executor.ModelConfig.from_dict(SHAPES["llama-3.1-8b"])
    weights = 2 * (32 * 218_103_808 + 128256 * 4096)
    per_token = 2 * 2 * 32 * 8 * 128
    assert per_token == 128 * 1024
    assert pp_phases.pp2_floor(config, 1, 0, 2) == 1.0
    tokens = weights / per_token  # the cache's tokens that weigh what the weights do
    assert abs(pp_phases.pp2_floor(config, 1, tokens, 2) - 4 / 3) < 1e-9
    assert 1.5 < pp_phases.pp2_floor(config, 256, 1056, 2) < 1.6
