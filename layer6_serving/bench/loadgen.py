"""A load generator for the OpenAI API, after `vllm bench serve`.

Requests are sent at a Poisson rate (or all at once: rate inf, a burst), at most
`max_concurrency` in flight, each streamed and greedy: a /v1/completions with EOS ignored so its
output length is what was asked (the random dataset), or a /v1/chat/completions (the chat
dataset, dataset.py). Per request it measures, as vLLM does: TTFT (send -> first text),
ITL (gaps between streamed chunks), TPOT ((e2e - TTFT) / (output tokens - 1)), E2EL; overall,
request and output-token throughput and goodput (requests/s meeting every SLO).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from .dataset import BenchRequest, as_request


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def random_prompts(n: int, input_len: int, output_len: int, vocab: int, *, range_ratio: float = 0.5,
                   seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt token ids, max_tokens): lengths uniform in [len * (1 - r), len * (1 + r)]."""
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))
    return [([rng.randrange(10, vocab) for _ in range(length(input_len))], length(output_len))
            for _ in range(n)]


def _text(chunk: dict) -> str:
    """The new text in a streamed chunk: `text` (completions) or `delta.content` (chat)."""
    out = ""
    for c in chunk.get("choices") or ():
        out += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return out


async def one_request(client: httpx.AsyncClient, url: str, model: str,
                      request: BenchRequest | tuple, max_tokens: int | None = None, *,
                      dialect: str = "vllm") -> RequestResult:
    """Send one streamed request; TTFT at the first chunk with text. Output tokens come from
    the usage the server reports, else one per text chunk."""
    if max_tokens is not None:  # the older (prompt, max_tokens) call
        request = (request, max_tokens)
    req = as_request(request)
    start, last, res, chunks = time.perf_counter(), None, RequestResult(ok=False), 0
    try:
        async with client.stream("POST", url + req.endpoint, json=req.body(model, dialect)) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk, now = json.loads(line[6:]), time.perf_counter()
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message", chunk["error"]))
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    res.output_tokens = chunk["usage"].get("completion_tokens", 0)
                if _text(chunk):
                    chunks += 1
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
        res.e2e, res.ok = time.perf_counter() - start, True
        res.output_tokens = res.output_tokens or chunks
        res.prompt_tokens = res.prompt_tokens or len(req.prompt_ids)
        if last is None:  # nothing streamed: the first token is the end
            res.ttft = res.e2e
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(url: str, model: str, requests: list[BenchRequest | tuple[list[int], int]], *,
                   rate: float = float("inf"), max_concurrency: int | None = None, seed: int = 0,
                   on_done=None, dialect: str = "vllm") -> tuple[list[RequestResult], float]:
    """Send `requests` (BenchRequests, or (prompt ids, max_tokens) pairs) at `rate` req/s
    (inf: a burst), at most max_concurrency at once; the results in order and the wall time."""
    rng = np.random.default_rng(seed)
    gate = asyncio.Semaphore(max_concurrency or len(requests))
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        async def go(request) -> RequestResult:
            async with gate:
                res = await one_request(client, url, model, request, dialect=dialect)
            if on_done:
                on_done(res)
            return res
        start, tasks = time.perf_counter(), []
        for request in requests:
            tasks.append(asyncio.create_task(go(request)))
            if rate != float("inf"):
                await asyncio.sleep(float(rng.exponential(1.0 / rate)))
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def _stats(values: list[float], prefix: str) -> dict:
    ms = np.array(values) * 1e3 if values else np.array([np.nan])
    return {f"mean_{prefix}_ms": float(np.mean(ms)), f"median_{prefix}_ms": float(np.median(ms)),
            f"p99_{prefix}_ms": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], duration: float, *, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    """vLLM's report: counts, throughputs, TTFT / TPOT / ITL / E2EL mean, median, p99 (ms),
    goodput (completed requests/s meeting the SLOs given)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if (slo_ttft_ms is None or r.ttft * 1e3 <= slo_ttft_ms)
            and (slo_tpot_ms is None or r.tpot is None or r.tpot * 1e3 <= slo_tpot_ms)]
    report = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
              "request_throughput": len(ok) / duration,
              "output_throughput": out_tokens / duration,
              "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
              "goodput": len(good) / duration,
              "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms}}
    report |= _stats([r.ttft for r in ok], "ttft")
    report |= _stats([r.tpot for r in ok if r.tpot is not None], "tpot")
    report |= _stats([g for r in ok for g in r.itls], "itl")
    report |= _stats([r.e2e for r in ok], "e2el")
    if len(ok) < len(results):
        report["first_error"] = next(r.error for r in results if not r.ok)
    return report
