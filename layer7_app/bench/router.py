"""prefix_aware vs round_robin on a multi-turn chat workload (CPU is enough to see it).

    python -m layer7_app.bench.router [--replicas 2] [--conversations 6] [--turns 4]

C conversations run at once, each T turns in a row: every turn sends the whole history so
far (a long shared system prompt, the earlier turns and their replies, a new question) and
streams the reply. Each policy gets fresh conversations (no cache carried over from the
other policy's run), on the same replicas. Measured per policy: the replicas' prefix-cache
hit rate over the run (prompt tokens found in the cache / looked up, from their /metrics)
and TTFT at the client (request sent -> first content byte), turn 1 (cold) and later turns.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import threading
import time

import httpx

import layer6_serving as l6

from ..router.app import start_router

SYSTEM = ("Thou art a player upon a stage in Verona; answer in the manner of the play, "
          "briefly, as the scene requires. ") * 4


def prefix_counters(url: str) -> tuple[float, float]:
    """(prefix_cache_hits, prefix_cache_queries) counters of one replica."""
    text = httpx.get(url + "/metrics", timeout=10).text

    def value(name: str) -> float:
        m = re.search(rf"^llm_stack:{name}_total{{[^}}]*}} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0
    return value("prefix_cache_hits"), value("prefix_cache_queries")


def conversation(router_url: str, tag: str, turns: int, ttfts: list, max_tokens: int) -> None:
    """One conversation of `turns` turns; appends (turn, ttft seconds) to ttfts."""
    msgs = [{"role": "system", "content": f"[{tag}] " + SYSTEM}]
    with httpx.Client(timeout=120) as c:
        for t in range(turns):
            msgs.append({"role": "user", "content": f"What news, good friend? Question {t}."})
            body = {"model": "course", "messages": msgs, "max_tokens": max_tokens,
                    "temperature": 0, "stream": True}
            start, first, reply = time.perf_counter(), None, ""
            with c.stream("POST", router_url + "/v1/chat/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    for ch in chunk.get("choices", []):
                        text = ch.get("delta", {}).get("content") or ""
                        if text and first is None:
                            first = time.perf_counter() - start
                        reply += text
            ttfts.append((t, first if first is not None else time.perf_counter() - start))
            msgs.append({"role": "assistant", "content": reply or "..."})


def run_policy(urls: list[str], policy: str, conversations: int, turns: int,
               max_tokens: int) -> dict:
    before = [prefix_counters(u) for u in urls]
    ttfts: list = []
    with start_router(urls, policy=policy) as router:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=conversation, daemon=True,
                                    args=(router.url, f"{policy}-{i}", turns, ttfts, max_tokens))
                   for i in range(conversations)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(600)
        wall = time.perf_counter() - t0
    after = [prefix_counters(u) for u in urls]
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    later = [s for t, s in ttfts if t > 0]
    return {"policy": policy, "requests": len(ttfts), "prefix_hit_rate": hits / max(queries, 1),
            "ttft_p50_ms": 1e3 * statistics.median(s for _, s in ttfts),
            "ttft_later_turns_p50_ms": 1e3 * statistics.median(later) if later else None,
            "ttft_later_turns_mean_ms": 1e3 * statistics.mean(later) if later else None,
            "wall_s": wall}


def bench_routing(replicas: int = 2, conversations: int = 6, turns: int = 4,
                  max_tokens: int = 16, policies=("round_robin", "prefix_aware")) -> list[dict]:
    """Start `replicas` course-model servers, run the workload under each policy."""
    handles = [l6.start_server(["course"]) for _ in range(replicas)]
    try:
        urls = [h.url for h in handles]
        run_policy(urls, "round_robin", 2, 1, 4)  # warm-up: every replica's first steps
        return [run_policy(urls, p, conversations, turns, max_tokens) for p in policies]
    finally:
        for h in handles:
            h.stop()


def main(argv: list[str] | None = None, prog: str = "python -m layer7_app.bench.router") -> int:
    ap = argparse.ArgumentParser(prog=prog, description="prefix_aware vs round_robin routing "
                                 "on a multi-turn chat workload")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    rows = bench_routing(args.replicas, args.conversations, args.turns, args.max_tokens)
    print("| policy | requests | prefix-cache hit rate | TTFT p50 (all) | TTFT p50 (turns 2+) "
          "| TTFT mean (turns 2+) | wall |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['policy']} | {r['requests']} | {r['prefix_hit_rate']:.0%} | "
              f"{r['ttft_p50_ms']:.0f} ms | {r['ttft_later_turns_p50_ms']:.0f} ms | "
              f"{r['ttft_later_turns_mean_ms']:.0f} ms | {r['wall_s']:.1f} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
