"""The compact summary of decode_prefill_engine.sh: decode MBU, prefill MFU, engine
throughput and the engine step's GPU-idle fraction, from the JSON files it wrote.

    python benchmarks/decode_prefill_engine_summary.py OUT_DIR

Reads OUT_DIR/{decode,prefill,engine}.json, OUT_DIR/profile_engine.json and
OUT_DIR/results/layer4/bench_{kernel,spec}.json; a missing file is reported as missing (its
step failed or timed out: see its log), not an error.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def summary(out: Path) -> list[str]:
    lines = [f"{'measurement':<58} {'figure':>14} {'of roofline':>12} {'target':>8}"]

    def row(what: str, figure: str, roof: str, target: str) -> None:
        lines.append(f"{what:<58} {figure:>14} {roof:>12} {target:>8}")

    d = _load(out / "decode.json")
    if d:
        row("decode 1B bs1 triton CUDA graph (tok/s; MBU)", f"{d['tokens_per_s']:.1f}",
            _pct(d["MBU"]), ">= 80%")
    else:
        row("decode: MISSING (decode.log)", "", "", "")
    p = _load(out / "prefill.json")
    if p:
        row(f"prefill 2048 x{len(p['runs_ms'])} (ms median; MFU median, min-max)",
            f"{p['ms']:.2f}", f"{_pct(p['MFU'])} ({_pct(p['MFU_min'])}-{_pct(p['MFU_max'])})",
            ">= 60%")
        if "bucket_graph_ms" in p:  # the same prompt replayed from its length bucket's CUDA graph
            row(f"prefill 2048 x{len(p['bucket_graph_runs_ms'])}, bucket CUDA graph (same runs)",
                f"{p['bucket_graph_ms']:.2f}", f"{_pct(p['bucket_graph_MFU'])} "
                f"({_pct(p['bucket_graph_MFU_min'])}-{_pct(p['bucket_graph_MFU_max'])})", ">= 60%")
        if "engine_ms" in p:  # the same prompt through layer 4's engine (LLM.generate)
            row(f"prefill 2048 x{len(p['engine_runs_ms'])}, through the engine (LLM.generate)",
                f"{p['engine_ms']:.2f}", f"{_pct(p['engine_MFU'])} "
                f"({_pct(p['engine_MFU_min'])}-{_pct(p['engine_MFU_max'])})", ">= 70%")
        if "graph_engine_ms" in p:  # the same engine with prefill_cuda_graph
            row(f"prefill 2048 x{len(p['graph_engine_runs_ms'])}, through the engine, prefill "
                f"graphs (tokens equal: {p['graph_tokens_equal']}, pool "
                f"{p['graph_engine_prefill_graph_pool_MiB']:.0f} MiB)",
                f"{p['graph_engine_ms']:.2f}", f"{_pct(p['graph_engine_MFU'])} "
                f"({_pct(p['graph_engine_MFU_min'])}-{_pct(p['graph_engine_MFU_max'])})",
                ">= 70%")
        if "first_decode_ms" in p:  # prefill + first decode, the decode launched early or not
            fd = p["first_decode_ms"]
            row(f"prefill 2048 + first decode, engine (tokens equal: "
                f"{p['first_decode_tokens_equal']}): launched behind the prefill / read first",
                f"{fd['overlapped']:.2f} / {fd['read_first']:.2f}",
                f"saved {p['first_decode_saved_ms']:.2f} ms", "")
    else:
        row("prefill: MISSING (prefill.log)", "", "", "")
    e = _load(out / "engine.json")
    if e:
        runs = " / ".join(f"{t:,.0f}" for t in e["runs_tokens_per_s"])
        row(f"engine 256 seqs (tok/s; runs {runs})", f"{e['tokens_per_s']:,.0f}",
            _pct(e["roofline_fraction"]), ">= 50%")
    else:
        row("engine: MISSING (engine.log)", "", "", "")
    g = _load(out / "profile_engine.json")
    if g:
        row(f"engine decode step, batch {g['steps'][0]['batch'] if g['steps'] else '?'} "
            "(wall ms; mean GPU idle)", f"{g['wall_ms_per_step']:.2f}",
            "idle " + _pct(g["mean_gpu_idle_fraction"]), "")
        row("CUDA-graph coverage (decode passes replayed / all)",
            f"{g['decode_passes'] - g['eager_decode_passes']}/{g['decode_passes']}", "", "all")
    else:
        row("profile_engine: MISSING (profile_engine.log)", "", "", "")
    k = _load(out / "results" / "layer4" / "bench_kernel.json")
    for r in (k or {}).get("rows", []):
        graph = r.get("graph_speedup")
        row(r["what"].replace("paged decode attention, ", "paged vs SDPA ")[:44]
            + " (do_bench; graph)",
            f"{r['ratio']:.2f}x; " + ("-" if graph is None else f"{graph:.2f}x"),
            _pct(r.get("roofline_fraction")), ">= 0.9x")
    if k is None:
        row("paged kernel: MISSING (kernel.log)", "", "", "")
    s = _load(out / "results" / "layer4" / "bench_spec.json")
    for r in (s or {}).get("rows", []):
        if "geometric mean" in r["what"]:
            row(f"{r['device']}: {r['what'].removesuffix(', geometric mean over the prompts')}"
                " (geomean x)", f"{r['ratio']:.2f}x", "", ">= 1.5x")
    if s is not None:
        same = all(r.get("matches_greedy", True) for r in s.get("rows", []))
        row("speculative: every run emitted plain greedy's tokens", str(same), "", "True")
    else:
        row("speculative: MISSING (spec.log)", "", "", "")
    return lines


if __name__ == "__main__":
    print("\n".join(summary(Path(sys.argv[1] if len(sys.argv) > 1 else "."))))
