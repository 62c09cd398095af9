"""Layer 6's commands for the `stack` CLI (entry point `llm_stack.layers` "6").

`run`: starts a server for the course model on 127.0.0.1 (its engine in a process of its
own, as `stack serve` runs it), drives it with the official `openai` client (a chat answer,
a streamed completion timed at the client, a burst of concurrent streams, clients that
disconnect mid-stream) and prints what it measured, including the server's own /metrics.
`bench`: the serving benchmark (serving.py).
"""
from __future__ import annotations

import argparse
import asyncio
import re
import time

import httpx
import openai
from rich.console import Console
from rich.table import Table

from ..server import start_server
from .loadgen import random_prompts, run_load, summarize
from .serving import bench as bench_main

TITLE = "async engine, OpenAI-compatible server, metrics, load generator"
console = Console()
if not console.is_terminal:  # piped or captured: wide tables instead of wrapped cells
    console = Console(width=160)


def run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="stack run --layer 6", description=__doc__.split("\n\n")[1])
    ap.add_argument("--model", default="course")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    with start_server([args.model], max_num_seqs=64, engine_process=True) as srv:
        console.print(f"[bold]server[/] {srv.url}/v1 up in {time.perf_counter() - t0:.1f} s "
                      f"(model {args.model!r})")
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        chat(client, args.model)
        stream(client, args.model, args.max_tokens)
        burst(srv, args.model, args.concurrency, args.max_tokens)
        disconnects(srv, args.model)
        show_metrics(srv)
    return 0


def chat(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "What news from Verona?"}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=48,
                                       temperature=0.8, seed=1)
    console.print(f"\n[bold]chat[/] (the model's own template): HORATIO asks "
                  f"{messages[0]['content']!r}\n  HAMLET: {r.choices[0].message.content!r}")
    console.print(f"  usage {r.usage.prompt_tokens} + {r.usage.completion_tokens} tokens, "
                  f"finish {r.choices[0].finish_reason}, "
                  f"server metrics {r.model_extra['llm_stack']}")


def stream(client: openai.OpenAI, model: str, max_tokens: int) -> None:
    start, first, gaps, last, text = time.perf_counter(), None, [], None, ""
    for chunk in client.completions.create(model=model, prompt="ROMEO.\n", max_tokens=max_tokens,
                                           temperature=0, stream=True):
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            first = first or now
            if last is not None:
                gaps.append(now - last)
            last, text = now, text + chunk.choices[0].text
    itl = sum(gaps) / len(gaps) if gaps else float("nan")
    console.print(f"\n[bold]one stream[/], measured at the client: "
                  f"TTFT {(first - start) * 1e3:.1f} ms, "
                  f"mean ITL {itl * 1e3:.1f} ms ({1 / itl:.0f} tok/s)\n  {text[:120]!r}")


def burst(srv, model: str, concurrency: int, max_tokens: int) -> None:
    vocab = srv.engines[model].info.vocab_size
    reqs = random_prompts(concurrency, 32, max_tokens, vocab, seed=0)
    results, dt = asyncio.run(run_load(srv.url, model, reqs))
    s = summarize(results, dt)
    t = Table(title=f"\n{concurrency} concurrent streams (burst), ~32 in / ~{max_tokens} out")
    for col in ("done", "out tok/s", "TTFT p50 / p99 ms", "TPOT p50 ms", "ITL p50 ms",
                "E2EL p50 ms"):
        t.add_column(col, justify="right")
    t.add_row(f"{s['completed']}/{concurrency}", f"{s['output_throughput']:.0f}",
              f"{s['median_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f}", f"{s['median_tpot_ms']:.1f}",
              f"{s['median_itl_ms']:.1f}", f"{s['median_e2el_ms']:.0f}")
    console.print(t)


def disconnects(srv, model: str, n: int = 8) -> None:
    body = {"model": model, "prompt": "HAMLET.\n", "max_tokens": 200, "stream": True,
            "ignore_eos": True}

    async def leave(c: httpx.AsyncClient) -> None:
        async with c.stream("POST", srv.url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return

    async def go() -> float:
        async with httpx.AsyncClient(timeout=60) as c:
            await asyncio.gather(*[leave(c) for _ in range(n)])
        start = time.perf_counter()
        while srv.engines[model].snapshot.requests and time.perf_counter() - start < 10:
            await asyncio.sleep(0.005)
        return time.perf_counter() - start
    freed = asyncio.run(go())
    snap = srv.engines[model].snapshot
    console.print(f"\n[bold]{n} clients left mid-stream[/]: all aborted {freed * 1e3:.0f} ms after "
                  f"the last left; running {snap.running}, KV blocks used {snap.kv_blocks_used}")


def show_metrics(srv) -> None:
    text = httpx.get(srv.url + "/metrics").text
    keep = ("num_requests_running", "kv_cache_usage_perc", "prefix_cache_hit_rate",
            "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_sum",
            "time_to_first_token_seconds_count")
    console.print("\n[bold]/metrics[/] (excerpt)")
    for line in text.splitlines():
        if re.match(r"llm_stack:(" + "|".join(keep) + r")\{", line):
            console.print("  " + line)


def bench(argv: list[str]) -> int:
    return bench_main(argv)
