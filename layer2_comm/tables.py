"""The console tables of `stack bench --layer 2` and `tune`: ours beside torch.distributed,
measured beside the alpha-beta prediction, the tuning grid, the overlap lines. Each printer
takes the console to write to (under torchrun only rank 0's prints)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .bench_tuning import best_configs
from .plots import SIDE_BY_SIDE, gbs, human, pairs, side_by_side, us


def _chunk(row: dict) -> str:
    return "whole" if row["chunk_bytes"] is None else human(row["chunk_bytes"])


def print_tune(console: Console, result: dict) -> None:
    table = Table(title="one ring step (send a segment right, receive one from the left)")
    for column in ("segment", "lanes", "us", "GB/s each way"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in result["steps"]:
        table.add_row(
            human(r["bytes"]), str(r["lanes"]), us(r["time_s"]), f"{r['bytes_per_s'] / 1e9:.1f}"
        )
    console.print(table)
    ref = {(r["collective"], r["bytes"]): r for r in result["reference"]}
    table = Table(title="ours per (lanes, piece size) vs torch.distributed; host = "
                        "time for a call to return")
    columns = ("collective", "size", "lanes", "pieces of", "n", "ours us", "host us",
               "busbw GB/s", "ratio")
    for column in columns:
        table.add_column(column, justify="right", no_wrap=True)
    for r in result["configs"]:
        t = ref.get((r["collective"], r["bytes"]))
        ratio = f"{r['busbw'] / t['busbw']:.2f}" if t and t["busbw"] else "-"
        table.add_row(r["collective"], human(r["bytes"]), str(r["lanes"]), _chunk(r),
                      str(r["pieces"]), us(r["time_s"]), us(r["host_s"]), gbs(r["busbw"]),
                      ratio + ("" if r["ok"] else " WRONG"))
    console.print(table)
    for b in best_configs(result):
        t, best, default = b["torch"], b["best"], b["default"]
        line = (f"{b['collective']} {human(b['bytes'])}: best lanes={best['lanes']}, "
                f"pieces of {_chunk(best)}")
        if t and t["busbw"]:
            line += f" {best['busbw'] / t['busbw']:.2f}x built-in"
            if default:
                line += f"; default {default['busbw'] / t['busbw']:.2f}x"
        console.print(line)
    by = {}
    for r in result["check"]:
        by.setdefault(r["bytes"], {})[
            "torch" if r["impl"] == "torch" else ("on" if r["check"] else "off")
        ] = r["time_s"]
    console.print("header check (all-reduce, us): " + "; ".join(
        f"{human(b)}: on {us(v.get('on', 0))}, off {us(v.get('off', 0))}, built-in "
        f"{us(v.get('torch', 0))}"
        for b, v in sorted(by.items())))


def print_overlap(console: Console, o: dict) -> None:
    """One line per variant: comm alone, compute alone, both, and the share of comm hidden."""
    console.print(f"overlap: {human(o['comm_bytes'])} all-reduce vs {o['matmul_n']}^2 "
                  f"{o['matmul_dtype']} matmuls ({o['backend']}); "
                  f"efficiency = (t_comp + t_comm - t_both) / min(t_comp, t_comm)"
                  + ("" if o["correct"] else " [red]WRONG RESULT"))
    variants = [("async handle", "", o.get("efficiency"), o.get("t_both_s"))]
    if "side_stream_efficiency" in o:
        variants.append(("side stream", "", o["side_stream_efficiency"], o["t_both_side_stream_s"]))
    if "lean_efficiency" in o:
        variants.append(
            (f"<= {o['lean_ctas']} CTAs", "lean_", o["lean_efficiency"], o["lean_t_both_s"])
        )
    for name, key, eff, both in variants:
        console.print(f"  {name:>13}: comm {us(o[key + 't_comm_s'])} us, compute "
                      f"{us(o[key + 't_comp_s'])} us "
                      f"({o[key + 'matmuls']} matmuls), both {us(both)} us "
                      f"-> {eff:.0%} of comm hidden")


def print_tables(console: Console, rows: list[dict], predicted: list[dict]) -> None:
    table = Table(title="ours vs torch.distributed: median time of the slowest rank")
    for column in SIDE_BY_SIDE:
        table.add_column(column.replace("busbw ", ""), justify="right", no_wrap=True)
    for cells in side_by_side(rows):
        table.add_row(*cells)
    console.print(table)
    for r in rows:
        if not r["ok"]:
            console.print(f"[red]{r['algorithm']} at {human(r['bytes'])} gave a wrong result")
    model = {(p["algorithm"], p["bytes"]): p["time_s"] for p in predicted}
    table = Table(title="all-reduce (ours): measured vs alpha-beta prediction")
    for column in ("algorithm", "size", "measured us", "predicted us", "ratio"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in rows:
        if (r["algorithm"], r["bytes"]) in model:
            p = model[r["algorithm"], r["bytes"]]
            table.add_row(r["algorithm"], human(r["bytes"]), us(r["time_s"]), us(p),
                          f"{r['time_s'] / p:.2f}" if p > 0 else "-")
    console.print(table)
    at: dict[str, tuple] = {}  # per collective, the largest size up to 256 MiB (the target's)
    for kind, b, o, t in pairs(rows):
        if b <= 256 << 20 and t["busbw"] and b >= at.get(kind, (0,))[0]:
            at[kind] = (b, o["busbw"] / t["busbw"])
    if at:
        console.print("ours / built-in busbw: " + ", ".join(
            f"{kind} {ratio:.2f} at {human(b)}" for kind, (b, ratio) in at.items()))
