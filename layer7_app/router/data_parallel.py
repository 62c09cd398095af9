"""`stack serve --dp N`: N layer-6 servers, one per GPU (or sharing the CPU), behind one router.

    stack serve --model course --dp 2 --port 8000     # two engines, one endpoint

Data parallelism for serving: when the model fits one GPU, N copies of the server on N GPUs
serve N times the requests (nothing crosses between them), which tensor parallelism on the
same GPUs does not. Each replica is `stack serve` itself, in a process of its own with
CUDA_VISIBLE_DEVICES set to its GPUs (--tp x --pp of them), on a free local port; the router
(policy least_loaded) listens on --port and spreads the requests. Every other option goes to
each replica unchanged. Ctrl-C or SIGTERM stops the router and every replica.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import layer6_serving as l6

from .app import start_router
from .policies import POLICIES

START_TIMEOUT_S = 600.0  # a replica loads its model and warms up before /health answers


def split_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this command's options: --dp, --host, --port, --policy; and, from the others, --tp and
    --pp read) and the arguments each replica gets (all but this command's own)."""
    ap = argparse.ArgumentParser(prog="stack serve --dp N", add_help=False)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--policy", choices=POLICIES, default="least_loaded")
    mine, rest = ap.parse_known_args(argv)
    sizes = argparse.ArgumentParser(add_help=False)
    sizes.add_argument("--tp", type=int, default=1)
    sizes.add_argument("--pp", type=int, default=1)
    mine.__dict__.update(vars(sizes.parse_known_args(rest)[0]))
    return mine, rest


def replica_gpus(dp: int, ranks: int, visible: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each replica ("0", "2,3", ...), or None each on a machine
    without GPUs; ValueError when the GPUs cannot hold dp replicas of `ranks` GPUs."""
    if dp < 1:
        raise ValueError(f"--dp must be >= 1, got {dp}")
    if visible == 0:
        return [None] * dp
    if dp * ranks > visible:
        raise ValueError(f"--dp {dp} replicas x {ranks} GPU(s) each needs {dp * ranks} GPUs; "
                         f"{visible} are visible")
    return [",".join(str(r * ranks + k) for k in range(ranks)) for r in range(dp)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_count() -> int:
    import torch  # noqa: PLC0415 (only to count the GPUs; no CUDA context is made)

    return torch.cuda.device_count()


def start_replicas(dp: int, rest: list[str], gpus: list[str | None],
                   timeout_s: float = START_TIMEOUT_S) -> tuple[list[subprocess.Popen], list[str]]:
    """Start dp `stack serve` processes and wait until each answers /health; returns the
    processes and their URLs. RuntimeError (all stopped) when one exits or never answers."""
    procs, urls = [], []
    code = "import sys, layer6_serving as l6; sys.exit(l6.serve_main(sys.argv[1:]))"
    try:
        for gpu in gpus:
            port = _free_port()
            env = dict(os.environ)
            if gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpu
            procs.append(subprocess.Popen([sys.executable, "-c", code, *rest, "--host",
                                           "127.0.0.1", "--port", str(port)], env=env))
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + timeout_s
        for i, (p, url) in enumerate(zip(procs, urls, strict=True)):
            l6.wait_healthy(url + "/health", p, timeout=max(0.0, deadline - time.monotonic()),
                            name=f"replica {i}", poll_s=0.5)
    except BaseException:
        stop_replicas(procs)
        raise
    return procs, urls


def stop_replicas(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def serve_dp_main(argv: list[str]) -> int:
    """`stack serve --dp N [any stack serve option]`; --dp 1 is plain `stack serve`."""
    try:
        args, rest = split_args(argv)
        if args.dp == 1:
            return l6.serve_main(rest + ["--host", args.host, "--port", str(args.port)])
        gpus = replica_gpus(args.dp, args.tp * args.pp, _gpu_count())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        procs, urls = start_replicas(args.dp, rest, gpus)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        handle = start_router(urls, policy=args.policy, host=args.host, port=args.port)
        where = ", ".join(f"GPU {g}" if g is not None else "CPU" for g in gpus)
        print(f"serving {args.dp} replicas ({where}) behind {handle.url}/v1 (Ctrl-C stops)")
        l6.run_until_interrupted(handle)
    finally:
        stop_replicas(procs)
    return 0
