"""The peer all-reduce measured: ours (one-shot, two-shot) vs NCCL vs torch's symm_mem ops.

`peer_bench_rank` runs on every rank of an NCCL group (launch() or torchrun):
- latency, 8 B .. 8 MiB (bf16, decode's dtype): each contender is captured in a CUDA graph of
  `per_graph` back-to-back calls and the graph replayed; time per call = replay / per_graph.
  Decode replays graphs, so this is the latency layer 5 sees, without Python's launch cost.
- bandwidth, 16 MiB .. 256 MiB: eager calls timed with CUDA events; busbw as nccl-tests.
Contenders on the same buffers in the same run: ours one_shot, ours two_shot (forced),
ours as chosen by size (`PeerAllReduce.algorithm`), NCCL (`dist.all_reduce`), and torch's
`symm_mem.one_shot_all_reduce` / `two_shot_all_reduce_` (input already in a symmetric buffer:
they skip the copy ours does inside its kernel). Every contender is checked once against
NCCL on integer-valued data (exact) before it is timed.

`summarize` turns rank 0's rows into the choice table and the alpha-beta comparison:
one-shot time = a + (W-1) n b, two-shot = 2a + 2(W-1)/W n b, fitted on our one-shot times;
NCCL's ring = A + 2(W-1)/W n B, fitted on NCCL's. Predicted crossovers (two-shot over one-shot,
NCCL over ours) beside the measured ones.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

from .bench_bandwidth import first_win, time_collective
from .cost_model import AlphaBeta, busbw, crossover, fit_alpha_beta, predict
from .group import device
from .peer_all_reduce import PeerAllReduce, choose

LATENCY_SIZES = [8 << (2 * i) for i in range(10)]  # 8 B .. 2 MiB, x4
BANDWIDTH_SIZES = [4 << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20, 256 << 20]
EAGER_SIZES = [8 << 10, 512 << 10]
GRAPHED_MAX = 8 << 20  # up to here (decode's sizes) each call is timed inside a CUDA graph
OURS = ("ours one_shot", "ours two_shot", "ours (by size)")
TORCH_SYMM = ("torch symm_mem one_shot", "torch symm_mem two_shot")


def _graph_time(fn: Callable[[], object], per_graph: int, iters: int, dev) -> float:
    """Seconds per call of fn, from a CUDA graph of per_graph calls (max over ranks, median)."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    samples = time_collective(graph.replay, iters, 3, dev)
    del graph
    return statistics.median(samples) / per_graph


def _contenders(n: int, dtype, ours: PeerAllReduce, symm: torch.Tensor | None, group_name: str,
                dev) -> dict[str, tuple[Callable[[], torch.Tensor], Callable[[], None]]]:
    """name -> (call returning the result, refill inputs) on this rank's buffers."""
    me = dist.get_rank()
    data = ((torch.arange(n, device=dev) % 7) + me).to(dtype)  # small integers: exact sums
    x, out, nccl_buf = data.clone(), torch.empty_like(data), data.clone()

    def forced(name: str) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            ours._launch(x, out, name)
            return out
        return call

    def refill_nccl() -> None:
        nccl_buf.copy_(data)

    table = {
        "ours one_shot": (forced("one_shot"), lambda: None),
        "ours two_shot": (forced("two_shot"), lambda: None),
        "ours (by size)": (lambda: ours(x, out), lambda: None),
        "NCCL": (lambda: (dist.all_reduce(nccl_buf), nccl_buf)[1], refill_nccl),
    }
    if symm is not None:
        view = symm[:n]

        def refill_symm() -> None:
            view.copy_(data)

        table["torch symm_mem one_shot"] = (
            lambda: torch.ops.symm_mem.one_shot_all_reduce(view, "sum", group_name), refill_symm)
        table["torch symm_mem two_shot"] = (
            lambda: torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", group_name), refill_symm)
    return table


def _expected(n: int, dtype, world: int, dev) -> torch.Tensor:
    i = torch.arange(n, device=dev) % 7
    return (i * world + world * (world - 1) // 2).to(dtype)


def _agree(ok: bool, dev) -> bool:
    flag = torch.tensor([0 if ok else 1], device=dev)
    dist.all_reduce(flag)
    return int(flag.item()) == 0


def peer_bench_rank(latency_sizes: list[int], bandwidth_sizes: list[int], iters: int,
                    per_graph: int = 20, dtype: torch.dtype = torch.bfloat16) -> dict | None:
    """Every contender at every size (see the module docstring); rank 0 returns the rows."""
    import torch.distributed._symmetric_memory as symm_mem

    dev, world = device(), dist.get_world_size()
    elsize = torch.empty(0, dtype=dtype).element_size()
    biggest = max([*latency_sizes, *bandwidth_sizes])
    # the default instance (8 MiB, tuned for decode) up to 8 MiB, a 256 MiB one above
    small = PeerAllReduce(device=dev)
    large = PeerAllReduce(max_bytes=biggest, device=dev)
    group_name = dist.group.WORLD.group_name
    try:
        symm = symm_mem.empty(biggest // elsize, dtype=dtype, device=dev)
        symm_mem.rendezvous(symm, dist.group.WORLD)
    except Exception:  # torch's own ops are only the reference; go on without them
        symm = None
    rows = []
    sizes = sorted({*latency_sizes, *bandwidth_sizes})
    for nbytes, graphed in [(s, s <= GRAPHED_MAX) for s in sizes]:
        n = max(1, nbytes // elsize)
        ours = small if n * elsize <= small.max_bytes else large
        for name, (call, refill) in _contenders(n, dtype, ours, symm, group_name, dev).items():
            try:
                refill()
                ok = bool(torch.equal(call().view(-1), _expected(n, dtype, world, dev)))
                ok = _agree(ok, dev)
                if graphed:
                    t = _graph_time(call, per_graph, iters, dev)
                else:
                    t = statistics.median(time_collective(call, iters, 2, dev))
                error = None
            except Exception as exc:  # a reference that fails here is reported, not fatal
                ok, t, error = False, math.nan, f"{type(exc).__name__}: {str(exc)[:200]}"
                if name in OURS:
                    raise
            real = n * elsize
            rows.append({"impl": name, "bytes": real, "dtype": str(dtype).removeprefix("torch."),
                         "world": world, "timing": "cuda graph" if graphed else "eager",
                         "time_s": t, "algbw": real / t if t and t == t else math.nan,
                         "busbw": (busbw(real / t, "all_reduce", world) if t and t == t
                                   else math.nan),
                         "ok": ok, "error": error, "blocks": ours.blocks if name in OURS else None})
    rows += _knob_rows(small, large, iters, dtype, dev, per_graph)
    small.close()
    large.close()
    rows += _gather_scatter_rows(bandwidth_sizes, iters, dtype, dev, per_graph)
    rows += _eager_rows(EAGER_SIZES, iters, dtype, dev)
    return {"rows": rows} if dist.get_rank() == 0 else None


# The kernel's knobs, each changed alone from the defaults, at the sizes where the targets
# are (decode sizes in graphs, 256 MiB eager): which way each one moves the time.
KNOB_SIZES = [(8, "one_shot"), (8 << 10, "one_shot"), (32 << 10, "one_shot"),
              (512 << 10, "one_shot"), (512 << 10, "two_shot"), (2 << 20, "two_shot"),
              (256 << 20, "two_shot")]
KNOBS = {"defaults": {}, "serial barrier": {"serial_barrier": True},
         "push gather": {"pull_gather": False}, "8 warps": {"num_warps": 8},
         "32 warps": {"num_warps": 32}, "2x blocks": {}}


def _knob_rows(small: PeerAllReduce, large: PeerAllReduce, iters: int, dtype, dev,
               per_graph: int) -> list[dict]:
    """Rows "knob <name> <algorithm>": one knob changed on the same instances, the rest at
    their defaults. The 8 B row also tells whether the main table's first size paid a warm-up
    (here everything is warm): it is the only size whose element count is not a multiple of
    16, which Triton compiles separately. "2x blocks" (above the small instance's buffer
    only) is a second large instance with twice the grid."""
    world, me = dist.get_world_size(), dist.get_rank()
    elsize = torch.empty(0, dtype=dtype).element_size()
    rows = []
    wide: PeerAllReduce | None = None
    for nbytes, algo in KNOB_SIZES:
        n = max(1, nbytes // elsize)
        ours = small if n * elsize <= small.max_bytes else large
        if n * elsize > ours.max_bytes:
            continue
        data = ((torch.arange(n, device=dev) % 7) + me).to(dtype)
        out = torch.empty_like(data)
        for knob, settings in KNOBS.items():
            if knob == "push gather" and algo != "two_shot":
                continue
            if knob == "2x blocks":
                if ours is small:
                    continue
                if wide is None:  # collective: every rank gets here in the same order
                    wide = PeerAllReduce(max_bytes=large.max_bytes, device=dev,
                                         blocks=2 * large.blocks)
                ours = wide
            saved = {k: getattr(ours, k) for k in settings}
            error, t, ok = None, math.nan, False
            try:
                for k, v in settings.items():
                    setattr(ours, k, v)
                ours._launch(data, out, algo)
                ok = _agree(bool(torch.equal(out, _expected(n, dtype, world, dev))), dev)
                def call(ours=ours, data=data, out=out, algo=algo) -> None:
                    ours._launch(data, out, algo)
                if n * elsize <= GRAPHED_MAX:
                    t = _graph_time(call, per_graph, iters, dev)
                else:
                    t = statistics.median(time_collective(call, iters, 2, dev))
            except Exception as exc:  # a knob that cannot run here is reported, not fatal
                error = f"{type(exc).__name__}: {str(exc)[:200]}"
                if torch.device(dev).type == "cuda":
                    torch.cuda.synchronize(dev)
            finally:
                for k, v in saved.items():
                    setattr(ours, k, v)
            rows.append({"impl": f"knob {knob} {algo}", "knob": knob, "algorithm": algo,
                         "bytes": n * elsize, "dtype": str(dtype).removeprefix("torch."),
                         "world": world,
                         "timing": "cuda graph" if n * elsize <= GRAPHED_MAX else "eager",
                         "time_s": t, "algbw": n * elsize / t if t == t else math.nan,
                         "busbw": (busbw(n * elsize / t, "all_reduce", world)
                                   if t == t else math.nan),
                         "ok": ok, "error": error, "blocks": ours.blocks,
                         "active": ours.active_blocks(algo, n, elsize)
                         if hasattr(ours, "active_blocks") else None})
    if wide is not None:
        wide.close()
    return rows


def _eager_rows(sizes: list[int], iters: int, dtype, dev) -> list[dict]:
    """One call at a time from Python, no graph: what an eager caller pays, host included."""
    world = dist.get_world_size()
    elsize = torch.empty(0, dtype=dtype).element_size()
    ours = PeerAllReduce(device=dev)
    rows = []
    for nbytes in sizes:
        x = torch.ones(nbytes // elsize, device=dev, dtype=dtype)
        out = torch.empty_like(x)
        for impl, call in (("ours eager", lambda x=x, out=out: ours(x, out)),
                           ("NCCL eager", lambda out=out: dist.all_reduce(out))):
            t = statistics.median(time_collective(call, iters, 3, dev))
            rows.append({"impl": impl, "bytes": nbytes, "dtype": str(dtype).removeprefix("torch."),
                         "world": world, "timing": "eager", "time_s": t, "algbw": nbytes / t,
                         "busbw": busbw(nbytes / t, "all_reduce", world), "ok": True,
                         "error": None})
    ours.close()
    return rows


def _gather_scatter_rows(sizes: list[int], iters: int, dtype, dev, per_graph: int) -> list[dict]:
    """All-gather (size = the gathered output) and reduce-scatter (size = the input), ours
    through peer memory vs NCCL's, as nccl-tests sizes them."""
    if not sizes:
        return []
    world, me = dist.get_world_size(), dist.get_rank()
    elsize = torch.empty(0, dtype=dtype).element_size()
    peer = PeerAllReduce(max_bytes=max(sizes), device=dev)
    rows = []
    for nbytes in sizes:
        n = nbytes // elsize // world * world
        shard = ((torch.arange(n // world, device=dev) % 7) + me).to(dtype)
        full = ((torch.arange(n, device=dev) % 7) + me).to(dtype)
        gathered = torch.empty(n, device=dev, dtype=dtype)
        scattered = torch.empty(n // world, device=dev, dtype=dtype)

        def nccl_gather(shard=shard, gathered=gathered):
            dist.all_gather_into_tensor(gathered, shard)
            return gathered

        def nccl_scatter(full=full, scattered=scattered):
            dist.reduce_scatter_tensor(scattered, full)
            return scattered

        calls = {
            ("all_gather", "ours"): lambda shard=shard: peer.all_gather(shard),
            ("all_gather", "NCCL"): nccl_gather,
            ("reduce_scatter", "ours"): lambda full=full: peer.reduce_scatter(full),
            ("reduce_scatter", "NCCL"): nccl_scatter,
        }
        for (kind, impl), call in calls.items():
            ok = _agree(True, dev)
            if impl == "ours":  # exact against NCCL's answer
                want = calls[(kind, "NCCL")]().clone()
                ok = _agree(bool(torch.equal(call(), want)), dev)
            graphed = n * elsize <= GRAPHED_MAX
            t = _graph_time(call, per_graph, iters, dev) if graphed else \
                statistics.median(time_collective(call, iters, 2, dev))
            rows.append({"impl": f"{impl} {kind}", "bytes": n * elsize,
                         "dtype": str(dtype).removeprefix("torch."),
                         "world": world, "timing": "cuda graph" if graphed else "eager",
                         "time_s": t, "algbw": n * elsize / t,
                         "busbw": busbw(n * elsize / t, kind, world), "ok": ok, "error": None})
    peer.close()
    return rows


def _times(rows: list[dict], impl: str) -> dict[int, float]:
    return {r["bytes"]: r["time_s"] for r in rows
            if r["impl"] == impl and r["time_s"] == r["time_s"]}


def summarize(rows: list[dict], world: int) -> dict:
    """Choice table (fastest measured vs chosen), alpha-beta fits and crossovers."""
    one, two, nccl = (_times(rows, k) for k in ("ours one_shot", "ours two_shot", "NCCL"))
    sizes = sorted(set(one) & set(nccl))
    fit_one = fit_alpha_beta([(world - 1) * s for s in sizes], [one[s] for s in sizes])
    ab = AlphaBeta(fit_one.alpha_s, fit_one.beta_s_per_byte)
    ring = fit_alpha_beta([2 * (world - 1) / world * s for s in sizes], [nccl[s] for s in sizes])
    choice = []
    for s in sizes:
        row = {"bytes": s, "chosen": choose(s, world),
               **{k: v[s] for k, v in (("one_shot", one), ("two_shot", two), ("nccl", nccl))
                  if s in v}}
        measured = {k: row[k] for k in ("one_shot", "two_shot", "nccl") if k in row}
        row["fastest"] = min(measured, key=measured.get)
        row["predicted"] = {
            "one_shot": predict("one_shot_all_reduce", s, world, ab),
            "two_shot": predict("two_shot_all_reduce", s, world, ab),
            "nccl": predict("ring_all_reduce", s, world, AlphaBeta(ring.alpha_s / (2 * (world - 1)),
                                                                    ring.beta_s_per_byte)),
        }
        choice.append(row)
    # ours (the better shot in the model) vs NCCL's ring: where the lines cross
    best = min(("one_shot_all_reduce", "two_shot_all_reduce"),
               key=lambda a: predict(a, 64 << 20, world, ab))
    nccl_line = (ring.alpha_s, 2 * (world - 1) / world * ring.beta_s_per_byte)
    ours_line = (predict(best, 0, world, ab), (predict(best, 1 << 30, world, ab)
                                               - predict(best, 0, world, ab)) / (1 << 30))
    slope = ours_line[1] - nccl_line[1]
    nccl_x = (nccl_line[0] - ours_line[0]) / slope if slope > 0 else None
    return {
        "alpha_s": ab.alpha_s, "beta_s_per_byte": ab.beta_s_per_byte,
        "nccl_alpha_s": ring.alpha_s, "nccl_beta_s_per_byte": ring.beta_s_per_byte,
        "two_over_one_predicted_bytes": crossover("one_shot_all_reduce", "two_shot_all_reduce",
                                                  world, ab),
        "two_over_one_measured_bytes": first_win(two, one),
        "nccl_over_ours_predicted_bytes": nccl_x if nccl_x and nccl_x > 0 else None,
        "nccl_over_ours_measured_bytes": first_win(
            nccl, {s: min(one[s], two.get(s, one[s])) for s in one}),
        "choice": choice,
    }
