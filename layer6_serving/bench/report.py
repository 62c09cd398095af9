"""What `stack bench --layer 6` prints (tables that fit 80 columns) and plots (latency vs
achieved load, one colour per server)."""
from __future__ import annotations

from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

console = Console()
if not console.is_terminal:  # piped or captured: still 80 columns
    console = Console(width=80)


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def print_report(report: dict, args) -> None:
    cfg = report["config"]
    console.print(f"\n[bold]layer 6 load[/]: {args.num_prompts} {args.dataset} requests, "
                  f"~{cfg['mean_prompt_tokens']:.0f} in / <= {cfg['mean_max_tokens']:.0f} out "
                  f"tokens, {args.max_num_seqs} seats, {cfg['num_blocks']} KV blocks, "
                  f"{report['device']}")
    for name, s in report["servers"].items():
        t = Table(title=f"{name} over HTTP (ms, p50 unless p99)", box=box.SIMPLE_HEAD,
                  pad_edge=False, title_justify="left")
        for col in ("rate", "req/s", "tok/s", "TTFT", "p99", "TPOT", "ITL", "E2EL", "good",
                    "fail"):
            t.add_column(col, justify="right")
        for r in s["rows"]:
            t.add_row("burst" if r["rate"] == "inf" else r["rate"].removesuffix(".0"),
                      f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.0f}",
                      f"{r['median_ttft_ms']:.0f}", f"{r['p99_ttft_ms']:.0f}",
                      f"{r['median_tpot_ms']:.1f}", f"{r['median_itl_ms']:.1f}",
                      f"{r['median_e2el_ms']:.0f}", f"{r['goodput']:.2f}", str(r["failed"]))
        console.print(t)
        errors = {r["first_error"] for r in s["rows"] if r.get("first_error")}
        for e in sorted(errors):
            console.print(f"[red]{name} failed[/]: {e}")
    console.print(f"rate: sent req/s; tok/s: output tokens/s; good: req/s with TTFT <= "
                  f"{args.slo_ttft_ms:g} and TPOT <= {args.slo_tpot_ms:g} ms")
    low = Table(title="low load: one request at a time", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("what", "TTFT p50 ms", "TTFT p99 ms"):
        low.add_column(col, justify="left" if col == "what" else "right")
    if "offline" in report:
        pre = sorted(report["offline"]["prefill_ms"])
        low.add_row("offline engine prefill (LLM)", f"{report['offline']['prefill_ms_p50']:.1f}",
                    f"{pre[min(len(pre) - 1, round(0.99 * (len(pre) - 1)))]:.1f}")
    for name, s in report["servers"].items():
        ll = s["low_load"]
        low.add_row(f"{name} over HTTP", f"{ll['median_ttft_ms']:.1f}", f"{ll['p99_ttft_ms']:.1f}")
    console.print(low)
    ratios = report["ratios"]
    if "ttft_minus_prefill_ms" in ratios:
        gap = ratios["ttft_minus_prefill_ms"]
        console.print(f"TTFT p50 - prefill p50: {gap:+.1f} ms (target <= 5 ms: "
                      f"{'met' if gap <= 5 else 'NOT met'})")
        off = report["offline"]["output_throughput"]
        console.print(f"offline engine, same workload: {off:.0f} out tok/s; HTTP burst = "
                      f"{ratios['http_over_offline_throughput']:.2f}x offline (target >= 0.9x)")
    for key, rows in ratios.items():
        if key.startswith("ours_over_"):
            peer = key.removeprefix("ours_over_")
            for r in rows:
                rate = "burst" if r["rate"] == "inf" else r["rate"].removesuffix(".0") + "/s"
                console.print(f"ours / {peer} at {rate}: output tok/s {_x(r['output_throughput'])}"
                              f", TTFT p50 {_x(r['ttft_p50'])}, TTFT p99 {_x(r['ttft_p99'])}")


def plot(report: dict, path: Path) -> None:
    """TTFT p50 / p99 and TPOT p50 against achieved request rate, per server."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = (("median_ttft_ms", "TTFT p50", "-", "o"), ("p99_ttft_ms", "TTFT p99", ":", "^"),
              ("median_tpot_ms", "TPOT p50", "--", "s"))
    for color, (name, s) in zip(("tab:blue", "tab:orange", "tab:green"),
                                report["servers"].items(), strict=False):
        x = [r["request_throughput"] for r in s["rows"]]
        for key, label, ls, marker in styles:
            ax.plot(x, [r[key] for r in s["rows"]], color=color, linestyle=ls, marker=marker,
                    label=f"{name}: {label}")
    if "offline" in report:
        ax.axhline(report["offline"]["prefill_ms_p50"], color="grey", linewidth=0.8,
                   label="offline engine: prefill p50")
    ax.set_xlabel("achieved request rate (req/s)")
    ax.set_ylabel("latency (ms, log scale)")
    ax.set_yscale("log")
    ax.set_title(f"layer 6: latency vs load ({report['config']['dataset']} dataset, "
                 f"{report['device']})")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
