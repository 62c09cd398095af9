"""Layer 4's bench rows as ratios and roofline fractions.

Every row of `stack bench --layer 4`'s JSON says, beside its raw figure, what it is as a
ratio to its reference measured in the same run (`ratio`, with `ratio_reference` naming
it) and as a fraction of its roofline (`roofline_fraction`; None with `roofline_note` where
this run measured no ceiling for it). The paged-kernel and speculative results, which the
bench keeps in `info` as nested tables, become rows here too, so `bench_kernel.json` and
`bench_spec.json` carry their figures in `rows` like the throughput bench does.
"""
from __future__ import annotations

NO_CPU_CEILING = "no CPU ceiling measured in this run (layer 0 measures the GPU's)"


def annotate(rows: list[dict], info: dict) -> list[dict]:
    """rows (changed in place: ratio fields added) plus one row per paged-kernel case and per
    speculative configuration found in info. Returns the full list."""
    hf = {r["device"]: r for r in rows
          if r["what"].startswith("transformers generate,") and "tokens_per_s" in r}
    off_ttft = {r["what"].removesuffix(", prefix cache off"): r["mean_ttft_s"]
                for r in rows if r["what"].endswith(", prefix cache off")}
    for r in rows:
        if r["what"].endswith(", prefix cache ON"):
            base = off_ttft.get(r["what"].removesuffix(", prefix cache ON"))
            _ratio(r, base / r["mean_ttft_s"] if base else None,
                   "mean TTFT without the prefix cache / with it, this run")
            _roofline(r, None, "TTFT: no roofline defined")
            continue
        if r["what"].endswith(", prefix cache off"):  # the reference of the row above
            _ratio(r, 1.0, "this row: the reference (TTFT without the prefix cache)")
            _roofline(r, None, "TTFT: no roofline defined")
            continue
        ref = hf.get(r["device"])
        if "ratio" not in r:
            value = (r["tokens_per_s"] / ref["tokens_per_s"]
                     if ref and "tokens_per_s" in r else None)
            _ratio(r, value, "transformers generate, same device, this run" if ref
                   else "no transformers row in this run")
        _roofline(r, r.get("roofline_fraction"),
                  None if r.get("roofline_fraction") is not None else
                  NO_CPU_CEILING if r.get("device") == "cpu" else "no roofline for this row")
    return rows + kernel_rows(info.get("paged_decode_kernel") or []) + \
        spec_rows(info.get("speculative") or {})


def kernel_rows(results: list[dict]) -> list[dict]:
    """One row per paged-decode case: ratio = SDPA time / ours (do_bench, and under CUDA-graph
    replay where measured), roofline = fraction of layer 0's copy bandwidth."""
    rows = []
    for k in results:
        splits = f", {k['num_splits']} splits" + ("" if k.get("auto", True) else " (forced)")
        row = {"what": f"paged decode attention, batch {k['batch']} x context {k['context']}"
                       f"{splits}",
               "device": "cuda", **{f: k.get(f) for f in (
                   "ours_us", "sdpa_us", "ours_graph_us", "sdpa_graph_us", "graph_speedup",
                   "sdpa_backend", "gbps", "max_abs_diff")}}
        _ratio(row, k["speedup"], "SDPA (fastest backend) on contiguous K/V, do_bench, this run")
        _roofline(row, k.get("of_copy"), None if k.get("of_copy") is not None
                  else "copy bandwidth not measured")
        rows.append(row)
    return rows


def spec_rows(results: dict) -> list[dict]:
    """One row per (device, prompt, speculative configuration), then one per (device,
    configuration) with the geometric-mean speed-up over the prompts. ratio = tokens/s over
    the target model alone on the same prompt, this run (greedy: the same tokens)."""
    rows = []
    for device, res in results.items():
        for prompt, p in res.get("prompts", {}).items():
            for e in p["rows"]:
                cfg = f"{e['method']} k={e['k']}" + (
                    f" stop_below={e['stop_below']}" if e["stop_below"] is not None else "")
                row = {"what": f"speculative {cfg}, prompt {prompt}", "device": device,
                       "tokens_per_s": e["tokens_per_s"],
                       "target_tokens_per_s": p["target_tokens_per_s"],
                       **{f: e[f] for f in ("method", "k", "stop_below", "matches_greedy",
                                            "acceptance_rate", "mean_tokens_per_round")}}
                _ratio(row, e["speedup"], "target model alone, same prompt, this run")
                _roofline(row, None, NO_CPU_CEILING if device == "cpu" else
                          "course model: launch-bound, no byte roofline defined")
                rows.append(row)
        for cfg, up in res.get("summary", {}).items():
            row = {"what": f"speculative {cfg}, geometric mean over the prompts",
                   "device": device}
            _ratio(row, up, "target model alone, same prompts, this run")
            _roofline(row, None, NO_CPU_CEILING if device == "cpu" else
                      "course model: launch-bound, no byte roofline defined")
            rows.append(row)
    return rows


def _ratio(row: dict, value: float | None, reference: str) -> None:
    row["ratio"], row["ratio_reference"] = value, reference


def _roofline(row: dict, value: float | None, note: str | None) -> None:
    row["roofline_fraction"] = value
    if note:
        row["roofline_note"] = note
