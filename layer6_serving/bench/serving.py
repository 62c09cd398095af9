"""`stack bench --layer 6`: the load generator against a server in its own process (or --url),
like `vllm bench serve`, beside the offline engine on the same workload and batch limits.

Steps (each server alone on the machine, the client in this process):
1. offline: layer 5's LLM over the same prompts: each prompt's prefill alone (time to its first
   token, one at a time), then the whole workload (output tok/s);
2. ours: `stack serve` as a subprocess with the same max_num_seqs and KV blocks; a warm-up
   burst that fills every seat (short replies, every batch size met), a low-load pass (the
   same prompts one at a time: TTFT p50 against the prefill p50), then each arrival rate
   (Poisson; "inf" = a burst);
3. --peer transformers: `transformers serve` on the same weights, the same passes.
It reports request and output-token throughput, TTFT / TPOT / ITL / E2EL mean, median and
p99, goodput under the SLOs, HTTP / offline and ours / peer; it writes bench.json and
latency_vs_load.png to --out (default $LLM_STACK_RESULTS/layer6, else ./results/layer6).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import statistics
import subprocess
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import layer5_parallel as l5

from .dataset import DATASETS, BenchRequest, chat_dataset, random_dataset
from .launch import ServerProcess, free_port, our_server_command
from .loadgen import run_load, summarize
from .offline import kv_blocks, offline_throughput, prefill_ms
from .peer import PEER_STOP_SIGNAL, PEERS, SHAPES, model_dir, peer_available, peer_command
from .report import console, plot, print_report


def results_dir(out: str | None = None) -> Path:
    path = Path(out) if out else Path(os.environ.get("LLM_STACK_RESULTS") or "results") / "layer6"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load(url: str, model: str, requests, label: str, rate: float, concurrency: int | None,
         seed: int, dialect: str = "vllm"):
    # a live bar on a terminal; one line per pass in a log
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(bar_width=30), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task("", total=len(requests))
        results, dt = asyncio.run(run_load(url, model, requests, rate=rate,
                                           max_concurrency=concurrency, seed=seed,
                                           on_done=lambda _: bar.advance(task),
                                           dialect=dialect))
    console.print(f"{label}: {sum(r.ok for r in results)}/{len(requests)} done in {dt:.1f} s")
    return results, dt


def drive(name: str, url: str, model: str, requests, warmup, low, args,
          dialect: str = "vllm", server: ServerProcess | None = None) -> dict:
    """Warm-up, the low-load pass (one request at a time) and every rate against one server
    (RuntimeError with its log if `server` dies on the way)."""
    def check(label: str) -> None:
        if server is not None and not server.alive:
            raise RuntimeError(f"{name} exited (code {server.proc.returncode}) during the "
                               f"{label} pass:\n{server.log_tail()}")

    results, _ = load(url, model, warmup, f"{name} warm-up", float("inf"), None, args.seed,
                      dialect)
    if not any(r.ok for r in results):  # no use loading a server that answers nothing
        if server is not None:  # a crash first shows as a dropped connection: let it land
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.proc.wait(2.0)
        check("warm-up")
        raise RuntimeError(f"{name} failed every warm-up request: {results[0].error}")
    check("warm-up")
    results, dt = load(url, model, low, f"{name} one at a time", float("inf"), 1, args.seed,
                       dialect)
    check("low-load")
    out = {"low_load": summarize(results, dt), "rows": []}
    for rate in args.rates:
        label = f"{name} burst" if rate == float("inf") else f"{name} rate {rate:g}/s"
        # a burst runs --repeats times and keeps its best pass, the statistic the offline
        # engine gets (a host whose speed drifts within a minute moves both sides alike)
        passes = []
        for _ in range(args.repeats if rate == float("inf") else 1):
            results, dt = load(url, model, requests, label, rate, args.max_concurrency,
                               args.seed, dialect)
            check(label)
            passes.append(dict(rate=str(rate), **summarize(
                results, dt, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)))
        best = max(passes, key=lambda row: row["output_throughput"])
        out["rows"].append(best | {"passes_output_throughput":
                                   [row["output_throughput"] for row in passes]})
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="stack bench --layer 6",
        description="Load-test the OpenAI server in its own process (like `vllm bench serve`) "
                    "beside the offline engine and, with --peer, transformers serve.")
    ap.add_argument("--url", help="an existing server (default: start one per run)")
    ap.add_argument("--model", default="course",
                    help="course, a model directory, a name layer 3 knows, or "
                         f"{', '.join(SHAPES)} (random weights written as a HF directory)")
    ap.add_argument("--dataset", choices=DATASETS, default="random")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=64, help="random: mean; chat: cap")
    ap.add_argument("--output-len", type=int, default=64, help="random: mean; chat: cap")
    ap.add_argument("--rates", default="2,8,inf", help="comma-separated req/s; inf = burst")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="every engine's seat limit")
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="every engine's KV blocks (default: enough for every seat)")
    ap.add_argument("--low-load-prompts", type=int, default=16,
                    help="prompts sent one at a time for TTFT vs prefill")
    ap.add_argument("--peer", choices=PEERS, default=None, help="serve the same model with it too")
    ap.add_argument("--device", default=None, help="for the peer (default: cuda if present)")
    ap.add_argument("--slo-ttft-ms", type=float, default=500.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads per engine process (a shared CPU: 1 avoids oversubscribed "
                         "OpenMP spinning)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="full runs of the offline engine and of each server's burst; the best "
                         "of each is compared (the same statistic on both sides)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="results folder")
    args = ap.parse_args(argv)
    try:
        args.rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        ap.error(f"--rates wants numbers or inf, got {args.rates!r}")
    if any(r <= 0 for r in args.rates):
        ap.error("every rate must be > 0 (inf for a burst)")
    if min(args.num_prompts, args.low_load_prompts, args.max_num_seqs, args.num_blocks or 1,
           args.repeats) < 1:
        ap.error("--num-prompts, --low-load-prompts, --max-num-seqs, --num-blocks, --repeats "
                 "must be >= 1")
    if args.peer and args.url:
        ap.error("--peer starts both servers itself: leave out --url")
    return args


def build_workload(args, tokenizer, vocab: int):
    """(requests, warm-up requests, low-load requests) for --dataset."""
    def make(n: int, seed: int):
        if args.dataset == "chat":
            return chat_dataset(n, tokenizer, max_input_len=args.input_len,
                                max_output_len=args.output_len, seed=seed)
        return random_dataset(n, args.input_len, args.output_len, vocab, tokenizer=tokenizer,
                              seed=seed)
    requests = make(args.num_prompts, args.seed)
    low = [BenchRequest(**{**r.__dict__, "max_tokens": min(r.max_tokens, 4)})
           for r in requests[:args.low_load_prompts]]
    # a burst that fills every seat with short replies of different lengths (4..19 tokens):
    # each server meets every batch size before it is measured, as the offline engine's
    # first, unmeasured run over the workload does for it (a first use of a shape warms
    # kernels and allocator in the step it happens in)
    warmup = [BenchRequest(**{**r.__dict__, "max_tokens": min(r.max_tokens, 4 + i % 16)})
              for i, r in enumerate(make(max(4, args.max_num_seqs), args.seed + 1))]
    return requests, warmup, low


def _sigterm(signum, frame) -> None:  # a service manager's stop: leave through the finally
    raise KeyboardInterrupt


def bench(argv: list[str]) -> int:
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        return _bench(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _bench(args: argparse.Namespace) -> int:
    out_dir = results_dir(args.out)
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.peer and (why := peer_available(args.peer)):
        console.print(f"[red]error:[/] --peer {args.peer}: {why}")
        return 2
    # the model both servers read: the course model's or a checkpoint's directory, or random
    # weights written once. Served by path, so no chat stop string is added (fixed lengths).
    served = str(model_dir(args.model, out_dir / "models")) if (
        args.peer or args.model in SHAPES or args.model == "course") else args.model
    report: dict = {"config": {k: v for k, v in vars(args).items()}, "device": device,
                    "servers": {}}
    # 1. offline, alone; its KV pool and seats are the servers' too
    llm = l5.LLM(served, max_num_seqs=args.max_num_seqs,
                 num_blocks=kv_blocks(args, l5.EngineConfig().block_size))
    num_blocks = llm.block_manager.num_blocks
    kv = {"block_size": llm.config.block_size, "num_blocks": num_blocks,
          "max_batch_tokens": llm.config.max_num_batched_tokens,
          "cuda_graph": bool(llm.config.cuda_graph)}
    tokenizer = llm.model.tokenizer
    dtype = str(next(llm.model.net.parameters()).dtype).removeprefix("torch.")
    requests, warmup, low = build_workload(args, tokenizer, llm.model.config.vocab_size)
    if args.url is None:
        console.print(f"offline engine: prefill of {len(low)} prompts, one at a time ...")
        pre = prefill_ms(llm, low)
        console.print(f"offline engine: {len(requests)} requests ...")
        report["offline"] = {**offline_throughput(llm, requests, args.repeats),
                             "prefill_ms_p50": statistics.median(pre), "prefill_ms": pre}
    report["config"] |= {"kv": kv, "num_blocks": num_blocks, "served_model": served, "dtype": dtype,
                         "mean_prompt_tokens": statistics.mean(len(r.prompt_ids)
                                                               for r in requests),
                         "mean_max_tokens": statistics.mean(r.max_tokens for r in requests)}
    llm.close()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    # 2. ours (and 3. the peer), each in its own process
    try:
        if args.url:
            report["servers"]["ours"] = drive("ours", args.url, args.model, requests, warmup,
                                              low, args)
        else:
            port = free_port()
            cmd = our_server_command(served, port, max_num_seqs=args.max_num_seqs,
                                     num_blocks=num_blocks)
            console.print("starting our server (stack serve) ...")
            with ServerProcess(cmd, f"http://127.0.0.1:{port}", name="ours", env=env) as srv:
                report["servers"]["ours"] = drive("ours", srv.url, served, requests, warmup,
                                                  low, args, server=srv)
        if args.peer:
            port = free_port()
            cmd, peer_env, name = peer_command(args.peer, Path(served), port, device=device,
                                               dtype=dtype, kv=kv)
            console.print(f"starting {args.peer} serve ...")
            with ServerProcess(cmd, f"http://127.0.0.1:{port}", name=args.peer,
                               env=env | peer_env, stop_signal=PEER_STOP_SIGNAL) as srv:
                report["servers"][args.peer] = drive(args.peer, srv.url, name, requests,
                                                     warmup, low, args, dialect=args.peer,
                                                     server=srv)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (a timeout): keep what was measured
        report["interrupted"] = True
        (out_dir / "bench.json").write_text(json.dumps(report, indent=2, default=str))
        console.print(f"interrupted: servers stopped; partial results in {out_dir / 'bench.json'}")
        return 130
    except RuntimeError as e:
        report["error"] = str(e)
        (out_dir / "bench.json").write_text(json.dumps(report, indent=2, default=str))
        console.print(f"[red]error:[/] {e}")
        return 1
    report["ratios"] = ratios(report)
    print_report(report, args)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2, default=str))
    plot(report, out_dir / "latency_vs_load.png")
    console.print(f"wrote {out_dir / 'bench.json'} and {out_dir / 'latency_vs_load.png'}")
    failed = sum(r["failed"] for s in report["servers"].values() for r in s["rows"])
    return 0 if failed == 0 else 1


def ratios(report: dict) -> dict:
    """HTTP / offline (burst throughput), TTFT p50 - prefill p50 at low load, ours / peer."""
    ours, out = report["servers"]["ours"], {}
    burst = next((r for r in ours["rows"] if r["rate"] == "inf"), ours["rows"][-1])
    if "offline" in report:
        off = report["offline"]
        out["http_over_offline_throughput"] = burst["output_throughput"] / off["output_throughput"]
        out["low_load_ttft_p50_ms"] = ours["low_load"]["median_ttft_ms"]
        out["prefill_p50_ms"] = off["prefill_ms_p50"]
        out["ttft_minus_prefill_ms"] = out["low_load_ttft_p50_ms"] - off["prefill_ms_p50"]
    for peer, s in report["servers"].items():
        if peer == "ours":
            continue
        out[f"ours_over_{peer}"] = [
            {"rate": a["rate"], "output_throughput": _ratio(a, b, "output_throughput"),
             "ttft_p50": _ratio(a, b, "median_ttft_ms"), "ttft_p99": _ratio(a, b, "p99_ttft_ms")}
            for a, b in zip(ours["rows"], s["rows"], strict=True)]
        out[f"{peer}_low_load_ttft_p50_ms"] = s["low_load"]["median_ttft_ms"]
    return out


def _ratio(a: dict, b: dict, key: str) -> float | None:
    """a[key] / b[key]; None where either side measured nothing (all failed)."""
    x, y = a[key], b[key]
    return x / y if y and y == y and x == x else None
