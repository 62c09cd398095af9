"""Layer 3's bench rows: prefill MFU over five runs, and every figure as a ratio and a
roofline fraction.

Each row of `stack bench --layer 3`'s JSON gets `ratio` (to a reference measured in the same
run, named by `ratio_reference`) and `roofline_fraction` (MBU for decode, MFU for prefill;
None with `roofline_note` where this run measured no ceiling, e.g. the CPU rows). `table`
renders them for the console.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from rich.table import Table

from . import bench as B
from .model import LlamaModel

NO_CPU_CEILING = "no CPU ceiling measured in this run (layer 0 measures the GPU's)"


def prefill_row(net: LlamaModel, tokens: int, backend: str, peak_flops: float,
                runs: int = 5) -> dict:
    """A `tokens`-token prefill measured `runs` times after a warm-up at the same shape
    (B.prefill_runs): median ms and MFU, and the spread (min / max MFU) over the runs, so one
    disturbed run shows as spread instead of as the figure."""
    secs = B.prefill_runs(net, tokens, runs=runs)
    med, flops = statistics.median(secs), B.prefill_flops(net, tokens)
    row = {"what": f"1B prefill {tokens} tokens, {backend} backend", "tokens_per_s": tokens / med,
           "ms": med * 1e3, "runs_ms": [s * 1e3 for s in secs], "MFU": flops / med / peak_flops,
           "MFU_min": flops / max(secs) / peak_flops, "MFU_max": flops / min(secs) / peak_flops}
    if net.device.type == "cuda":  # is the eager figure the GPU's or the host's?
        split = B.prefill_split(net, tokens)
        row.update(host_enqueue_ms=split["host_enqueue_s"] * 1e3,
                   graph_ms=split["graph_s"] * 1e3,
                   graph_MFU=flops / split["graph_s"] / peak_flops,
                   host_bound=split["host_enqueue_s"] > split["graph_s"])
    return row


def annotate(rows: list[dict], info: dict) -> list[dict]:
    """Add ratio / ratio_reference / roofline_fraction (/ roofline_note) to every row, in place."""
    hf = [r for r in rows if r["what"].startswith("transformers generate") and "tokens_per_s" in r]
    hf_best = max(hf, key=lambda r: r["tokens_per_s"], default=None)
    triton_bf16 = _find(rows, "triton backend, CUDA graph")
    torch_prefill = _find(rows, "prefill", "torch backend")
    target = _find(rows, "course target")
    bw = info.get("copy_bandwidth")
    bytes_per_token = next((r["bytes_per_token"] for r in rows if "bytes_per_token" in r), None)
    for r in rows:
        what = r["what"]
        if what.startswith("course"):
            ref = target if "draft" in what else r
            _set(r, ref, "course target, same run" if ref is not r
                 else "this row: the reference (draft over it)", None, NO_CPU_CEILING)
        elif "prefill" in what:
            ref = torch_prefill if "triton" in what else r
            _set(r, ref, "torch-backend prefill, same run" if ref is not r
                 else "this row: the reference", r.get("MFU"), None)
        elif "W8A16" in what:
            _set(r, triton_bf16, "bf16 triton decode, same run", r.get("MBU"), None)
        else:  # batch-1 decode of the 1B shape: ours or transformers', against the fastest HF
            mbu = r.get("MBU")
            if mbu is None and bw and bytes_per_token and "tokens_per_s" in r:
                mbu = r["tokens_per_s"] * bytes_per_token / bw  # same shape, P and N
            _set(r, hf_best, f"fastest transformers row ({hf_best['what']}), same run"
                 if hf_best else "no transformers row in this run", mbu,
                 None if mbu is not None else "copy bandwidth not measured")
    return rows


def unmeasured_roofline(row: dict, notes: list[str]) -> str | None:
    """'-*', '-**', ... for a row whose roofline fraction was not measured (its reason joins
    `notes`, printed under the table with as many stars); None when it was measured."""
    if row.get("roofline_fraction") is not None:
        return None
    note = row.get("roofline_note", "not measured")
    notes += [note] if note not in notes else []
    return "-" + "*" * (notes.index(note) + 1)


def rows_table(layer: int, columns: Sequence[tuple[str, str]], rows: list[dict],
               cells: Callable[[dict, list[str]], list[str] | None]) -> Table:
    """A layer's benchmark rows as a console table: columns are (name, justify) pairs, and
    cells(row, notes) gives a row's cells (None leaves the row out) and may add notes (as
    `unmeasured_roofline` does), printed in the caption with their stars."""
    t = Table(title=f"Layer {layer} (ratio: see ratio_reference in the JSON)")
    for col, justify in columns:
        t.add_column(col, justify=justify)
    notes: list[str] = []
    for r in rows:
        row = cells(r, notes)
        if row is not None:
            t.add_row(*row)
    t.caption = "  ".join(f"{'*' * (i + 1)} {n}" for i, n in enumerate(notes)) or None
    return t


def table(rows: list[dict]) -> Table:
    """The console table, readable at 80 columns: tokens/s, ms, ratio to the reference ("ref"
    on the reference rows), roofline (prefill: median, min-max over its runs, and the GPU-only
    figure of one CUDA-graph replay). A roofline the run did not measure shows as "-" with its
    note in the caption."""
    return rows_table(3, (("what", "left"), ("tok/s", "right"), ("ms", "right"),
                          ("ratio", "right"), ("roofline", "left")), rows, _cells)


def _cells(r: dict, notes: list[str]) -> list[str]:
    ms = r.get("ms_per_token", r.get("ms"))
    kind = "MFU" if "MFU" in r else "MBU"
    roof = unmeasured_roofline(r, notes) or f"{kind} {r['roofline_fraction']:.0%}"
    if "MFU_min" in r:
        roof += f" ({r['MFU_min'] * 100:.0f}-{r['MFU_max']:.0%}, {len(r['runs_ms'])} runs)"
    if r.get("graph_MFU") is not None:
        roof += f"\nGPU-only {r['graph_MFU']:.0%}" + (", host-bound" if r.get("host_bound")
                                                      else "")
    ratio = "ref" if r.get("is_reference") else (
        f"{r['ratio']:.2f}x" if r.get("ratio") is not None else "-")
    return [r["what"], f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "",
            f"{ms:.2f}" if ms else "", ratio, roof]


def _find(rows: list[dict], *parts: str) -> dict | None:
    return next((r for r in rows if all(p in r["what"] for p in parts)), None)


def _set(row: dict, ref: dict | None, reference: str, roofline: float | None,
         note: str | None) -> None:
    ok = ref is not None and "tokens_per_s" in row and "tokens_per_s" in ref
    row["ratio"] = row["tokens_per_s"] / ref["tokens_per_s"] if ok else None
    row["ratio_reference"] = reference
    row["is_reference"] = ref is row  # its ratio is 1 by definition
    row["roofline_fraction"] = roofline
    if note:
        row["roofline_note"] = note
