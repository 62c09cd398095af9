"""Run the server: in-process in a background thread (`start_server`), or from the command
line (`serve_main`, i.e. `stack serve`).

    with start_server(["course"]) as srv:          # port 0: a free port
        openai.OpenAI(base_url=srv.url + "/v1", api_key="x").completions.create(...)

Several models share one server, each with its own engine (its own KV budget and engine
thread, or engine process with engine_process=True, as `stack serve` runs); a request goes
to the engine of the model it names.
"""
from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from fastapi import FastAPI

from .api import create_app
from .api.limits import MAX_BODY_BYTES
from .app_thread import AppThread, bind, run_until_interrupted
from .async_engine import AsyncEngine

ModelSpec = str | Path | Mapping | AsyncEngine


def build_engines(models: Sequence[str | Path] | Mapping[str, ModelSpec], *,
                  tensor_parallel_size: int = 1, **engine_kwargs) -> dict[str, AsyncEngine]:
    """models: names/paths (served under that name), or name -> path | dict of AsyncEngine
    arguments ({"model": path, "num_blocks": 256, ...}) | a ready AsyncEngine. engine_kwargs
    go to each AsyncEngine (engine_process=True: each engine in its own process)."""
    specs = dict(models) if isinstance(models, Mapping) else {str(m): str(m) for m in models}
    if not specs:
        raise ValueError("no models to serve")
    engines: dict[str, AsyncEngine] = {}
    try:
        for name, spec in specs.items():
            if isinstance(spec, AsyncEngine):
                engines[name] = spec
                continue
            kwargs = dict(engine_kwargs, tensor_parallel_size=tensor_parallel_size)
            if isinstance(spec, Mapping):
                kwargs.update(spec)
                spec = kwargs.pop("model", name)
            engines[name] = AsyncEngine(spec, name=name, **kwargs)
    except BaseException:
        for e in engines.values():
            e.shutdown()
        raise
    return engines


class ServerHandle:
    """A running server: `url` ("http://127.0.0.1:43123"), `engines`, `app`, `stop()`."""

    def __init__(self, app: FastAPI, engines: dict[str, AsyncEngine], sock: socket.socket,
                 owned: list[AsyncEngine]) -> None:
        self.app, self.engines, self._owned = app, engines, owned
        self._http = AppThread(app, sock)
        self.host, self.port, self.url = self._http.host, self._http.port, self._http.url

    @property
    def alive(self) -> bool:
        """Serving: the HTTP thread runs and no engine has given up restarting."""
        return self._http.alive and self.fatal is None

    @property
    def fatal(self) -> str | None:
        """Why the server cannot go on (an engine whose restarts keep failing), else None."""
        return next((e.loop.fatal for e in self.engines.values() if e.loop.fatal), None)

    def stop(self) -> None:
        """Stop accepting, end the uvicorn thread, stop the engines this server built."""
        self._http.stop()
        for e in self._owned:
            e.shutdown()
        self._owned = []

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(models: Sequence[str | Path] | Mapping[str, ModelSpec] = ("course",), *,
                 host: str = "127.0.0.1", port: int = 0, tensor_parallel_size: int = 1,
                 api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 docs: bool | None = None, open_metrics: bool = False,
                 **engine_kwargs) -> ServerHandle:
    """Build an engine per model, serve them with uvicorn in a background thread, and return
    once the server accepts requests. port=0 picks a free port."""
    engines = build_engines(models, tensor_parallel_size=tensor_parallel_size, **engine_kwargs)
    owned = [e for name, e in engines.items()
             if not (isinstance(models, Mapping) and isinstance(models[name], AsyncEngine))]
    try:
        app = create_app(engines, api_key=api_key, max_body_bytes=max_body_bytes, docs=docs,
                         open_metrics=open_metrics)
        return ServerHandle(app, engines,
                            bind(host, port), owned)
    except BaseException:
        for e in owned:
            e.shutdown()
        raise


def serve_main(argv: list[str]) -> int:
    """`stack serve --model M [--model M2 ...] [--host H] [--port P] [--tp N] [--api-key K]`.
    Each model's engine runs in a process of its own (--engine-thread: a thread here)."""
    ap = argparse.ArgumentParser(prog="stack serve", description="OpenAI-compatible server")
    ap.add_argument("--model", action="append", help='"course" (default), a checkpoint '
                    "directory, or a name the model loader knows; repeat to serve several")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas, one per GPU, "
                    "behind one router (`stack serve --dp N`: layer 7 starts them)")
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV blocks per model")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-waiting", type=int, default=512, help="queue limit before 429")
    ap.add_argument("--metrics-open", action="store_true", help="with --api-key: leave "
                    "/metrics open (for a Prometheus that sends no key)")
    ap.add_argument("--docs", action="store_true", default=None, help="with --api-key: serve "
                    "/docs and /openapi.json all the same (without a key they are on)")
    ap.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                    help="largest request body accepted (413 above it)")
    ap.add_argument("--request-timeout", type=float, default=None, help="seconds per request")
    ap.add_argument("--stall-timeout", type=float, default=5.0, help="seconds an engine may "
                    "make no progress with requests open before /health reports it stalled")
    ap.add_argument("--max-restarts", type=int, default=3, help="failed engine restarts in a "
                    "row (or deaths within a minute) before the server exits non-zero")
    ap.add_argument("--policy", choices=("fcfs", "priority"), default="fcfs")
    ap.add_argument("--engine-thread", action="store_true", help="run each engine in a thread "
                    "of the server process instead of a process of its own (slower: one GIL)")
    args = ap.parse_args(argv)
    if args.dp != 1:
        print("error: --dp N starts N servers behind layer 7's router: run it as "
              "`stack serve --dp N`", file=sys.stderr)
        return 2
    kwargs = {k: v for k, v in (("num_blocks", args.num_blocks),
                                ("max_num_seqs", args.max_num_seqs),
                                ("pipeline_parallel_size", args.pp if args.pp != 1 else None))
              if v is not None}
    try:
        handle = start_server(args.model or ["course"], host=args.host, port=args.port,
                              tensor_parallel_size=args.tp, api_key=args.api_key,
                              max_body_bytes=args.max_body_bytes, docs=args.docs,
                              open_metrics=args.metrics_open,
                              max_waiting=args.max_waiting, request_timeout=args.request_timeout,
                              policy=args.policy, engine_process=not args.engine_thread,
                              stall_timeout=args.stall_timeout, max_restarts=args.max_restarts,
                              **kwargs)
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"serving {', '.join(handle.engines)} on {handle.url}/v1 (Ctrl-C stops)")
    run_until_interrupted(handle)
    if handle.fatal:
        print(f"error: {handle.fatal}", file=sys.stderr)
        return 1
    return 0
