"""`stack bench --layer 6`: the load generator against a server (started here, or --url),
like `vllm bench serve`, beside the offline engine on the same workload.

For each arrival rate (Poisson; "inf" = a burst) it reports request and output-token
throughput, TTFT / TPOT / ITL / E2EL mean, median and p99, and goodput under the SLOs; the
offline `LLM.generate` over the same prompts and lengths gives the ratio HTTP / offline.
Writes bench.json and latency_vs_load.png to $LLM_STACK_RESULTS/layer6 (default
./results/layer6).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import layer5_parallel as l5

from .loadgen import random_prompts, run_load, summarize
from .server import start_server

console = Console()
if not console.is_terminal:
    console = Console(width=160)


def results_dir() -> Path:
    path = Path(os.environ.get("LLM_STACK_RESULTS") or "results") / "layer6"
    path.mkdir(parents=True, exist_ok=True)
    return path


def offline_throughput(llm, requests) -> float:
    """Output tokens/s of the offline engine over the same prompts and lengths (warm)."""
    params = [l5.SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in requests]
    llm.generate([p for p, _ in requests[:4]], params[:4])  # warm-up
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def load(url: str, model: str, requests, rate: float, concurrency: int | None, seed: int):
    with Progress(TextColumn(f"[bold]rate {rate:g}/s"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("", total=len(requests))
        return asyncio.run(run_load(url, model, requests, rate=rate, max_concurrency=concurrency,
                                    seed=seed, on_done=lambda _: bar.advance(task)))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["request_throughput"] for r in rows]
    for key, label in (("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"),
                       ("median_tpot_ms", "TPOT p50"), ("median_e2el_ms", "E2EL p50")):
        ax.plot(x, [r[key] for r in rows], marker="o", label=label)
    ax.set_xlabel("achieved request rate (req/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title("layer 6: latency vs load")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="stack bench --layer 6", description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="an existing server (default: start one here)")
    ap.add_argument("--model", default="course")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rates", default="2,8,inf", help="comma-separated req/s; inf = burst")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--slo-ttft-ms", type=float, default=500.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    # The offline engine below gets a KV pool of its own beside the server's: on a GPU each
    # takes at most 40% of free memory, so both fit.
    handle = None if args.url else start_server([args.model], max_num_seqs=64,
                                                gpu_memory_utilization=0.4)
    try:
        url = args.url or handle.url
        vocab = handle.engines[args.model].llm.model.config.vocab_size if handle else 4096
        requests = random_prompts(args.num_prompts, args.input_len, args.output_len, vocab,
                                  seed=args.seed)
        load(url, args.model, requests[:4], float("inf"), None, args.seed)  # warm-up
        rows = []
        for rate in rates:
            results, duration = load(url, args.model, requests, rate, args.max_concurrency,
                                     args.seed)
            rows.append(dict(rate=str(rate), **summarize(
                results, duration, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)))
        offline = None
        if handle:
            engine = handle.engines[args.model]
            llm = l5.LLM(engine.llm.model, num_blocks=engine.llm.block_manager.num_blocks,
                         max_num_seqs=64)
            offline = offline_throughput(llm, requests)
    finally:
        if handle:
            handle.stop()
    table = Table(title=f"layer 6 load: {args.num_prompts} requests, ~{args.input_len} in / "
                        f"~{args.output_len} out tokens")
    for col in ("rate", "req/s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50 ms", "ITL p50 ms",
                "E2EL p50 ms", "goodput", "failed"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["rate"], f"{r['request_throughput']:.2f}",
                      f"{r['output_throughput']:.0f}",
                      f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f}",
                      f"{r['median_tpot_ms']:.1f}", f"{r['median_itl_ms']:.1f}",
                      f"{r['median_e2el_ms']:.0f}", f"{r['goodput']:.2f}", str(r["failed"]))
    console.print(table)
    burst = next((r for r in rows if r["rate"] == "inf"), rows[-1])
    if offline:
        console.print(f"offline engine, same workload: {offline:.0f} output tok/s; HTTP burst "
                      f"{burst['output_throughput']:.0f} tok/s = "
                      f"{burst['output_throughput'] / offline:.2f}x offline")
    out = results_dir()
    (out / "bench.json").write_text(json.dumps({"rows": rows, "offline_output_tok_s": offline},
                                               indent=2, default=str))
    plot(rows, out / "latency_vs_load.png")
    console.print(f"wrote {out / 'bench.json'} and {out / 'latency_vs_load.png'}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1
