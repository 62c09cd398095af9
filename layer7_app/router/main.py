"""`stack route`: the router from the command line.

    stack route --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 \\
                --policy prefix_aware --port 9000
    stack route --model course --min-replicas 1 --max-replicas 3 --port 9000   # autoscaled
"""
from __future__ import annotations

import argparse
import sys

import layer6_serving as l6

from .app import start_router
from .autoscale import Autoscaler
from .policies import POLICIES


class UsageError(ValueError):
    """A mistake in the command line: one line, exit 2."""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="stack route", description="OpenAI-compatible router "
                                 "over layer-6 replicas (layer 7)")
    ap.add_argument("--replica", action="append", default=[], metavar="URL",
                    help="a layer-6 server (http://HOST:PORT); repeat for each")
    ap.add_argument("--policy", choices=POLICIES, default="round_robin")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--load-bound", type=int, default=4, help="prefix_aware: in-flight excess "
                    "over the least-loaded replica before a conversation leaves its home")
    ap.add_argument("--health-interval", type=float, default=1.0, help="seconds between checks")
    ap.add_argument("--model", default=None, help="autoscale local replicas of this model")
    ap.add_argument("--min-replicas", type=int, default=None)
    ap.add_argument("--max-replicas", type=int, default=None)
    ap.add_argument("--scale-up-at", type=float, default=2.0,
                    help="requests in flight per replica above which one more starts")
    return ap


def build_autoscaler(args: argparse.Namespace) -> Autoscaler | None:
    """The autoscaler the flags ask for, or None; UsageError for half a request."""
    scaling = (args.min_replicas, args.max_replicas)
    if args.model is None:
        if any(v is not None for v in scaling):
            raise UsageError("--min-replicas/--max-replicas need --model (what to start)")
        return None
    lo = 1 if args.min_replicas is None else args.min_replicas
    hi = max(lo, 2) if args.max_replicas is None else args.max_replicas
    try:
        return Autoscaler(args.model, min_replicas=lo, max_replicas=hi, up_at=args.scale_up_at,
                          down_at=min(0.5, args.scale_up_at / 2))
    except ValueError as e:
        raise UsageError(str(e)) from None


def route_main(argv: list[str]) -> int:
    """Run the router until Ctrl-C / SIGTERM. User mistakes: `error: ...`, exit 2."""
    args = _parser().parse_args(argv)
    try:
        autoscaler = build_autoscaler(args)
        if args.port < 0 or args.port > 65535:
            raise UsageError(f"--port must be 0-65535, got {args.port}")
        handle = start_router(args.replica, policy=args.policy, host=args.host, port=args.port,
                              load_bound=args.load_bound, autoscaler=autoscaler,
                              health_interval=args.health_interval)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = len(handle.replicas.replicas)
    print(f"routing ({args.policy}) over {n} replica(s) on {handle.url}/v1 (Ctrl-C stops)")
    l6.run_until_interrupted(handle)
    return 0
