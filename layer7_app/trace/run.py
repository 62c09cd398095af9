"""`stack trace "prompt"`: one request followed from layer 7 down to the kernels.

    stack trace "ROMEO.\\n" [--max-tokens 16] [--no-router] [--out results/layer7/trace.json]

It starts the course model's engine, a layer-6 server over it and (unless --no-router) a
router in front, all in this process on 127.0.0.1; sends one warm-up request (not traced:
a first step pays one-off costs), then the traced one, streamed, as a client would. It
writes a Chrome/Perfetto trace (open it at ui.perfetto.dev or chrome://tracing) and prints
the time per layer (table.py) and the kernels per token.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

import layer6_serving as l6

from ..router import ReplicaSet, create_router_app, make_policy
from .hooks import EngineProbe, SpanMiddleware
from .kernels import kernel_spans
from .spans import Recorder, Span, write_trace
from .table import partition, print_table


def served(app) -> l6.AppThread:
    """An ASGI app on 127.0.0.1 (a free port) in a uvicorn thread."""
    return l6.AppThread(app, l6.bind("127.0.0.1", 0), start_timeout=60)


@dataclass
class TraceResult:
    spans: list[Span]
    rows: list[tuple[str, float]]  # (layer, seconds): a partition of the wall time
    wall_s: float
    tokens: int
    kernels: dict
    path: Path | None


def stream_once(url: str, body: dict) -> tuple[int, str]:
    """Send one streamed completion; returns (content chunks, text)."""
    chunks, text = 0, ""
    with httpx.Client(timeout=120) as c, c.stream("POST", url + "/v1/completions",
                                                 json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise ValueError(f"the server refused the request: {resp.text}")
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                for ch in chunk.get("choices", []):
                    if ch.get("text"):
                        chunks += 1
                        text += ch["text"]
    return chunks, text


def trace_request(prompt: str, *, model: str = "course", max_tokens: int = 16,
                  router: bool = True, out: Path | None = None) -> TraceResult:
    """Trace one streamed completion of `prompt` through (router ->) server -> engine."""
    if not prompt:
        raise ValueError("the prompt is empty")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
    rec = Recorder()
    engine = l6.AsyncEngine(model, name=model)
    servers: list[l6.AppThread] = []
    try:
        probe = EngineProbe(engine, rec)
        server = served(SpanMiddleware(l6.create_app({model: engine}), rec, "server.http", 6))
        servers.append(server)
        entry = server.url
        if router:
            app = create_router_app(ReplicaSet([server.url]), make_policy("round_robin"))
            servers.append(served(SpanMiddleware(app, rec, "router.proxy", 7)))
            entry = servers[-1].url
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": True}
        stream_once(entry, dict(body, max_tokens=4))  # warm-up, not traced
        rec.enabled = True
        start = time.perf_counter()
        chunks, text = stream_once(entry, body)
        rec.add("client.request", 8, start, time.perf_counter(), prompt=prompt, text=text)
        rec.enabled = False
        deadline = time.monotonic() + 10  # the profiler stops on the engine thread
        while probe.profile is None and time.monotonic() < deadline:
            time.sleep(0.01)
        rec.enabled = True
        kernels = kernel_spans(probe.profile, probe.forward_starts, rec) if probe.profile \
            else {"time_s": 0.0, "leaf_ops": 0, "top_ops": []}
        rec.enabled = False
    finally:
        for s in reversed(servers):
            s.stop()
        engine.shutdown()
    tokens = max(1, len(rec.named("scheduler.step")))  # one token per step (no speculation)
    rows, wall = partition(rec, kernels["time_s"])
    path = write_trace(out, rec.spans, prompt=prompt, tokens=tokens) if out else None
    return TraceResult(rec.spans, rows, wall, tokens, kernels, path)


def trace_main(argv: list[str]) -> int:
    """`stack trace`; user mistakes: `error: ...`, exit 2."""
    ap = argparse.ArgumentParser(prog="stack trace", description="Follow one request from "
                                 "layer 7 down to the kernels")
    ap.add_argument("prompt")
    ap.add_argument("--model", default="course")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-router", action="store_true", help="send straight to the server")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("LLM_STACK_RESULTS")
                                                     or "results") / "layer7" / "trace.json",
                    help="where the trace JSON goes (default $LLM_STACK_RESULTS/layer7/)")
    args = ap.parse_args(argv)
    try:
        result = trace_request(args.prompt.replace("\\n", "\n"), model=args.model,
                               max_tokens=args.max_tokens, router=not args.no_router,
                               out=args.out)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_table(result)
    print(f"wrote {result.path} (open it at https://ui.perfetto.dev or chrome://tracing)")
    return 0
