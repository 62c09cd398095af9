"""Sweep the paged decode kernel's launch configs and split counts on a GPU:
the 12 shapes `stack bench --layer 4 --only kernel` lists (batch 1/4/8/32 x context
1k/4k/16k, every sequence at the full context, int32 tables) and one engine-like shape
(batch 256, contexts uniform in 100..1124 as the nano-vllm workload's first decode steps,
int64 tables 132 wide as the CUDA-graph runner's), Llama-3.2-1B heads (32 q, 8 kv, D 64),
bf16, pages of 16, blocks shuffled across the cache.

Per shape: every (BLOCK_N, warps, stages, grid order[, merge parts a round trip]) x split
count under CUDA-graph replay
(what the engine pays, as the bench's graph column), SDPA's best backend/layout under the
same replay, then eager do_bench (L2 flushed, as the bench's first column) of the best
config launched directly, through the JIT, and through layer 4's wrapper, plus each path's
host cost per call (calls back to back, one sync). Prints a compact table, the best config
per shape, and writes OUT/sweep_paged.json.

    python benchmarks/sweep_paged.py --out DIR [--budget-s 75] [--quick] [--shapes B:CTX,...]
        [--configs I,J,...] [--splits S,...] [--heads HQ:HKV:D]

--defaults B:CTX,...: no sweep; layer 4's wrapper with its own picks ("after"), the same
with the previous split rule, merge tile and peeled first tile ("before": SPLIT_BELOW 1.5,
32 parts a merge round trip, PEEL_FIRST), and SDPA, per shape: graph replay and do_bench.
"""
# ruff: noqa: B023  (every lambda is timed inside its own loop iteration)
from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import time
from pathlib import Path

import torch
import triton
from paged_decode_latency import compile_only  # (run from benchmarks/: its directory)

import layer3_model as l3

pd = importlib.import_module("layer1_kernels.paged_decode")  # the package's name is the function
HQ, HKV, D, PAGE = 32, 8, 64, 16
# the engine's shape first, then the bench's small shapes (the worst ratios) before the big ones
SHAPES = [(256, "engine"), (1, 1024), (4, 1024), (8, 1024), (1, 4096), (4, 4096), (32, 1024),
          (8, 4096), (1, 16384), (4, 16384), (32, 4096), (8, 16384), (32, 16384)]
CONFIGS = [(64, 2, 2, False), (64, 4, 2, False), (64, 4, 3, False), (128, 4, 1, False),
           (128, 4, 2, False), (128, 4, 3, False), (128, 8, 2, False), (256, 4, 2, False),
           (256, 8, 1, False), (256, 8, 2, False), (64, 4, 2, True), (128, 4, 2, True),
           (256, 8, 2, True),
           # 13-17: heads first with the merge tile's parts (5th: 32 = 3 programs an SM at
           # D 64, 8 = 5) and the unpipelined / 3-stage loops; 18: D 128's unsplit default
           (128, 4, 2, True, 32), (128, 4, 2, True, 8), (128, 4, 1, True), (128, 4, 3, True),
           (64, 4, 1, True), (128, 8, 2, True),
           # 19-22: kv heads packed in a program (6th: heads; tiles of 128 key rows but 22's
           # 128): 4 heads x 32 keys (127 registers: 4 an SM), 2 x 64, 4 x 32 in 3 stages,
           # 8 x 16 (a token's whole 1 KB row in one run)
           (32, 4, 2, True, 4, 4), (64, 4, 2, True, 8, 2), (32, 4, 3, True, 4, 4),
           (16, 4, 2, True, 4, 8),
           # 23-28: each step's block ids in the software pipeline (7th: pipelined_ids; 5
           # stages: ids two steps before the keys and values, those two before their math;
           # 7: three), 128 or 64 keys, the merge tile's default or 16 parts, 4 or 8 warps
           (128, 4, 5, True, 0, 1, True), (128, 4, 7, True, 0, 1, True),
           (64, 4, 5, True, 0, 1, True), (64, 4, 7, True, 0, 1, True),
           (128, 4, 5, True, 16, 1, True), (128, 8, 5, True, 0, 1, True),
           # 29: 23 with the first tile peeled off the loop (8th: peel; its ids loaded before
           # the PDL wait, as without pipelined ids)
           (128, 4, 5, True, 0, 1, True, True)]
T0 = time.perf_counter()
DEV, DTYPE = "cuda", torch.bfloat16  # a CPU smoke run swaps them
ENGINE_LENS, ENGINE_WIDTH = (100, 1125), 2112  # max_model_len 2 * 1024 + 64


def log(*a):
    print(f"[{time.perf_counter() - T0:5.1f}s]", *a, flush=True)


def case(B: int, n, gen: torch.Generator) -> dict:
    if n == "engine":
        lens = torch.randint(*ENGINE_LENS, (B,), generator=gen, device=DEV)
        width, idx = ENGINE_WIDTH // PAGE, torch.int64
    else:
        lens = torch.full((B,), n, device=DEV)
        width, idx = n // PAGE, torch.int32
    need = (lens + PAGE - 1) // PAGE
    total = int(need.sum())
    perm = torch.randperm(total, generator=gen, device=DEV)
    tables = torch.zeros(B, width, dtype=torch.int64, device=DEV)
    start = 0
    for b, k in enumerate(need.tolist()):  # each sequence's blocks, shuffled across the cache
        tables[b, :k] = perm[start:start + k]
        start += k
    kc = torch.randn(total, PAGE, HKV, D, generator=gen, device=DEV, dtype=DTYPE)
    vc = torch.randn_like(kc)
    q = torch.randn(B, HQ, D, generator=gen, device=DEV, dtype=DTYPE)
    c = dict(q=q, k=kc, v=vc, t=tables.to(idx), n=lens.to(idx), kv_bytes=int(lens.sum()) * HKV
             * D * 2 * 2 + 2 * B * HQ * D * 2, max_ctx=width * PAGE)
    if n != "engine":  # contiguous copies for SDPA
        c["kd"], c["vd"] = (x[tables].reshape(B, -1, HKV, D)[:, :n].transpose(1, 2).contiguous()
                            for x in (kc, vc))
    return c


SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def split_options(B: int, max_ctx: int, splits=SPLITS) -> list[int]:
    return [s for s in splits if s == 1 or (max_ctx // s >= 64 and B * HKV * s <= 132 * 48)]


def cfg_dict(c) -> dict:
    return {"BLOCK_N": c[0], "num_warps": c[1], "num_stages": c[2],
            **({"merge_s": c[4]} if len(c) > 4 and c[4] else {}),
            **({"heads": c[5]} if len(c) > 5 else {}),
            **({"pipelined_ids": c[6]} if len(c) > 6 else {}),
            **({"peel": c[7]} if len(c) > 7 else {})}


def ours(c: dict, cfg, splits: int):
    return lambda: pd.paged_decode(c["q"], c["k"], c["v"], c["t"], c["n"], 0.125, None, splits,
                                   config=cfg_dict(cfg), heads_first=cfg[3])


def graph_us(fn, est_us: float = 20.0) -> float:
    calls = 20 if est_us < 50 else 5
    replays = max(3, min(20, int(3000 / (calls * max(est_us, 1.0)))))
    return l3.graph_replay_us(fn, calls=calls, replays=replays, warmup=2)


def host_us(fn, calls: int = 300) -> float:
    """Host time per call: calls back to back (the GPU is faster at these shapes), one sync."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e6 / calls


def sdpa_fns(c: dict) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = c["q"], c["kd"], c["vd"]
    B = q.shape[0]
    f = torch.nn.functional.scaled_dot_product_attention
    lay = {"gqa": lambda: f(q[:, :, None], k, v, scale=0.125, enable_gqa=True),
           "rows": lambda: f(q.view(B, HKV, HQ // HKV, D), k, v, scale=0.125)}
    out = {}
    for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
               SDPBackend.EFFICIENT_ATTENTION):
        for name, fn in lay.items():
            def call(fn=fn, be=be):
                with sdpa_kernel(be):
                    return fn()
            try:
                call()
            except RuntimeError:
                continue
            out[f"{be.name.lower().removesuffix('_attention')}/{name}"] = call
    return out


def old_graph_us(path: str, c: dict, splits: int, est: float) -> float:
    """The kernel file at `path` (an earlier version, loaded as a module of layer1_kernels)
    under graph replay, with the config layer 4 gave it then (BLOCK_N 128, 4 warps, 2 stages)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("layer1_kernels._old_paged_decode", path)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    cfg = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}
    return graph_us(lambda: old.paged_decode(c["q"], c["k"], c["v"], c["t"], c["n"], 0.125, None,
                                             splits, config=cfg), est)


def old_splits(B: int, max_ctx: int) -> int:
    """layer 4's split rule before this sweep: ~8 programs per SM, parts >= 128 keys."""
    return max(1, min(-(-8 * 132 // (B * HKV)), -(-max_ctx // 128), 64))


class before_rules:
    """Layer 1's previous split rule (no split from 1.5 programs an SM, 32-part launches
    uncapped), merge tile (32 parts a round trip), 2 stages everywhere and first tile peeled
    off the loop, for a before/after in one run (layer 4's kept plans dropped); peel_only:
    today's rules with the first tile peeled."""

    NAMES = ("SPLIT_BELOW", "MERGE_PARTS", "UNSPLIT_UP_TO", "PROGRAMS_PER_SM_WIDE_MERGE",
             "FEW_PROGRAM_STAGES")
    BEFORE = (1.5, 32, 0, 4, 2)  # (4 programs an SM: no cap on 32-part launches)

    def __init__(self, pa, peel_only: bool = False):
        self.pa, self.peel_only = pa, peel_only

    def __enter__(self):
        self.saved = [getattr(pd, n) for n in self.NAMES], pd.PEEL_FIRST["on"]
        if not self.peel_only:
            for n, v in zip(self.NAMES, self.BEFORE, strict=True):
                setattr(pd, n, v)
        pd.PEEL_FIRST["on"] = True
        self.pa._PLANS.clear()

    def __exit__(self, *exc):
        for n, v in zip(self.NAMES, self.saved[0], strict=True):
            setattr(pd, n, v)
        pd.PEEL_FIRST["on"] = self.saved[1]
        self.pa._PLANS.clear()


COLD_CACHES = 3


def cold_row(args, pa, item: str) -> dict:
    """Graph replay with every call on its own K/V: COLD_CACHES caches (each larger than a
    third of L2 at these shapes) in turn, so a call finds little of its K/V in L2 from the
    call before (as a model's layers do: each reads its own cache), ours and SDPA alike."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    b, n = item.split(":")
    B, n = int(b), int(n)
    cases = [case(B, n, gen) for _ in range(COLD_CACHES)]
    ours = [lambda c=c: pa.paged_decode_attention(c["q"], c["k"], c["v"], c["t"], c["n"], 0.125)
            for c in cases]
    replay = functools.partial(l3.graph_replay_us, calls=7, replays=10, warmup=2)
    row = dict(batch=B, context=n, ours_us=replay(ours))
    pd.PIPELINED_IDS["on"] = not pd.PIPELINED_IDS["on"]
    try:
        row["flip_us"] = replay(ours)
    finally:
        pd.PIPELINED_IDS["on"] = not pd.PIPELINED_IDS["on"]
    per_case = [sdpa_fns(c) for c in cases]
    times = {k: replay([f[k] for f in per_case]) for k in per_case[0]}
    row["sdpa"] = min(times, key=times.get)
    row["sdpa_us"] = times[row["sdpa"]]
    log(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return row


def defaults(args, do_bench) -> int:
    """Before/after at a few shapes: the wrapper's own picks vs the old kernel's, and SDPA."""
    pa = importlib.import_module("layer4_algorithms.kv.paged_attention")
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    for item in args.defaults.split(","):
        b, n = item.split(":")
        B, n = int(b), (n if n == "engine" else int(n))
        c = case(B, n, gen)
        est = max(2.0, c["kv_bytes"] / 2.5e6)

        def new():
            return pa.paged_decode_attention(c["q"], c["k"], c["v"], c["t"], c["n"], 0.125)
        row = dict(batch=B, context=n, splits=pa.pick_num_splits(B, HKV, c["max_ctx"],
                                                                 c["q"].device, D),
                   new_graph_us=graph_us(new, est),
                   new_bench_us=do_bench(new, warmup=5, rep=25, return_mode="median") * 1e3)
        with before_rules(pa):  # the previous split rule and merge tile, same kernel code
            row["before_splits"] = pa.pick_num_splits(B, HKV, c["max_ctx"], c["q"].device, D)
            row["before_graph_us"] = graph_us(new, est)
            row["before_bench_us"] = do_bench(new, warmup=5, rep=25, return_mode="median") * 1e3
        with before_rules(pa, peel_only=True):  # today's rules, the first tile peeled
            row["peel_graph_us"] = graph_us(new, est)
        if args.flip_pipelined:  # the same picks with layer 1's PIPELINED_IDS knob flipped
            unflipped = new().float()
            pd.PIPELINED_IDS["on"] = not pd.PIPELINED_IDS["on"]
            try:
                row["flip_graph_us"] = graph_us(new, est)
                row["flip_bench_us"] = do_bench(new, warmup=5, rep=25,
                                                return_mode="median") * 1e3
                row["flip_max_diff"] = (new().float() - unflipped).abs().max().item()
            finally:
                pd.PIPELINED_IDS["on"] = not pd.PIPELINED_IDS["on"]
        if B <= 8:  # host cost per call, direct launch vs the JIT (and the same output)
            row["host_direct_us"] = host_us(new)
            a = new()
            pd._DIRECT["on"] = False
            row["host_jit_us"] = host_us(new)
            row["direct_equals_jit"] = bool(torch.equal(a, new()))
            pd._DIRECT["on"] = True
        if args.old:
            row["old_splits"] = old_splits(B, c["max_ctx"])
            row["old_graph_us"] = old_graph_us(args.old, c, row["old_splits"], est)
        if "kd" in c:
            fns = sdpa_fns(c)
            times = {k: graph_us(f) for k, f in fns.items()}
            best = min(times, key=times.get)
            row.update(sdpa=best, sdpa_graph_us=times[best], sdpa_bench_us=do_bench(
                fns[best], warmup=5, rep=25, return_mode="median") * 1e3)
        row["new_tbps"] = c["kv_bytes"] / row["new_graph_us"] / 1e6
        if "sdpa_graph_us" in row:
            row["ratio_graph_before_after"] = (row["sdpa_graph_us"] / row["before_graph_us"],
                                               row["sdpa_graph_us"] / row["new_graph_us"])
            row["ratio_bench_before_after"] = (row["sdpa_bench_us"] / row["before_bench_us"],
                                               row["sdpa_bench_us"] / row["new_bench_us"])
        rows.append(row)
        log(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in row.items()))
    cold = [cold_row(args, pa, item) for item in (args.cold.split(",") if args.cold else [])]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "defaults_paged.json").write_text(json.dumps(
        {"rows": rows, "cold": cold}, indent=1, default=str))
    print("\nbatch context | splits before after | sdpa/ours graph before after (peeled) | "
          "do_bench before after")
    flip = args.flip_pipelined
    for r in rows:
        g = r.get("ratio_graph_before_after") or (math.nan, math.nan)
        d = r.get("ratio_bench_before_after") or (math.nan, math.nan)
        p = r.get("sdpa_graph_us", math.nan) / r["peel_graph_us"]
        print(f"{r['batch']:5} {r['context']!s:>7} | {r['before_splits']:>3} {r['splits']:>3} | "
              f"{g[0]:.2f} {g[1]:.2f} ({p:.2f}) | {d[0]:.2f} {d[1]:.2f}")
    if flip:
        print(f"\nbatch context | PIPELINED_IDS {pd.PIPELINED_IDS['on']} -> "
              f"{not pd.PIPELINED_IDS['on']}: graph us, sdpa/ours | do_bench us, sdpa/ours | diff")
        for r in rows:
            sg, sb = r.get("sdpa_graph_us", math.nan), r.get("sdpa_bench_us", math.nan)
            print(f"{r['batch']:5} {r['context']!s:>7} | {r['new_graph_us']:7.1f} -> "
                  f"{r['flip_graph_us']:7.1f}  {sg / r['new_graph_us']:.2f} -> "
                  f"{sg / r['flip_graph_us']:.2f} | {r['new_bench_us']:7.1f} -> "
                  f"{r['flip_bench_us']:7.1f}  {sb / r['new_bench_us']:.2f} -> "
                  f"{sb / r['flip_bench_us']:.2f} | {r['flip_max_diff']:.1e}")
    if cold:
        print(f"\nbatch context | cold: {COLD_CACHES} caches in turn, graph us: ours (flipped) "
              "| SDPA | sdpa/ours (flipped)")
        for r in cold:
            print(f"{r['batch']:5} {r['context']!s:>7} | {r['ours_us']:7.1f} ({r['flip_us']:7.1f}) "
                  f"| {r['sdpa_us']:7.1f} {r['sdpa']:<10} | {r['sdpa_us'] / r['ours_us']:.2f} "
                  f"({r['sdpa_us'] / r['flip_us']:.2f})")
    return 0


def precompile(cases: dict, configs=CONFIGS) -> None:
    """Compile every config for both index dtypes at once (paged_decode_latency.compile_only),
    instead of one by one at first call."""
    with compile_only(pd):
        for c in cases.values():
            for cfg in configs:
                ours(c, cfg, 2)()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget-s", type=float, default=75.0,
                    help="stop sweeping new shapes after this many seconds")
    ap.add_argument("--quick", action="store_true", help="4 configs, 3 shapes (a smoke run)")
    ap.add_argument("--shapes", default=None, metavar="B:CTX,...",
                    help="sweep only these shapes (e.g. 32:1024,32:4096,32:16384)")
    ap.add_argument("--configs", default=None, metavar="I,J,...",
                    help="only these entries of CONFIGS (indices)")
    ap.add_argument("--splits", default=None, metavar="S,...",
                    help="only these split counts (default: 1 to 64)")
    ap.add_argument("--heads", default=None, metavar="HQ:HKV:D",
                    help="query heads, kv heads, head dim (default 32:8:64, Llama-3.2-1B)")
    ap.add_argument("--old", default=None,
                    help="an earlier paged_decode.py (git show REV:layer1_kernels/paged_decode.py"
                         " > FILE): timed at the engine shape with its own config, as 'before'")
    ap.add_argument("--cold", default=None, metavar="B:CTX,...",
                    help="with --defaults: also these shapes under graph replay with "
                         f"{COLD_CACHES} caches in turn (each call's K/V mostly from DRAM)")
    ap.add_argument("--flip-pipelined", action="store_true",
                    help="with --defaults: also time layer 4's picks with layer 1's "
                         "PIPELINED_IDS knob flipped (each step's block ids pipelined or not)")
    ap.add_argument("--defaults", default=None, metavar="B:CTX,...",
                    help="no sweep: time layer 4's wrapper with its own picks (and --old with "
                         "the old picks, and SDPA) at these shapes, e.g. 256:engine,1:16384")
    args = ap.parse_args(argv)
    if args.heads:
        global HQ, HKV, D
        HQ, HKV, D = (int(x) for x in args.heads.split(":"))
    from triton.testing import do_bench
    if args.defaults:
        return defaults(args, do_bench)

    def bench_us(fn) -> float:  # as the bench's first column: median, L2 flushed
        return do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3
    configs = CONFIGS[:4] if args.quick else CONFIGS
    if args.configs:
        configs = [CONFIGS[int(i)] for i in args.configs.split(",")]
    splits = tuple(int(x) for x in args.splits.split(",")) if args.splits else SPLITS
    shapes = SHAPES[:3] if args.quick else SHAPES
    if args.shapes:
        shapes = [(int(b), n if n == "engine" else int(n))
                  for b, n in (item.split(":") for item in args.shapes.split(","))]
    gen = torch.Generator(device=DEV).manual_seed(0)
    log(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    reps = {"int32": case(1, 1024, gen), "int64": case(2, "engine", gen)}
    try:
        precompile(reps, configs)
        log("precompiled", len(configs), "configs x 2 index dtypes")
    except Exception as err:  # noqa: BLE001  (then each compiles at its first call)
        log("precompile failed:", type(err).__name__, str(err)[:200])
    results, rows = [], []
    for B, n in shapes:
        if time.perf_counter() - T0 > args.budget_s:
            log("budget spent: skipping", (B, n))
            continue
        c = case(B, n, gen)
        row = dict(batch=B, context=n, kv_bytes=c["kv_bytes"])
        ref = None
        if "kd" in c:
            fns = sdpa_fns(c)
            ref = next(iter(fns.values()))().reshape(B, HQ, D).float()
            times = {k: graph_us(f) for k, f in fns.items()}
            best = min(times, key=times.get)
            row.update(sdpa=best, sdpa_graph_us=times[best],
                       sdpa_bench_us=bench_us(fns[best]))
        pa = importlib.import_module("layer4_algorithms.kv.paged_attention")
        auto = pa.pick_num_splits(B, HKV, c["max_ctx"], c["q"].device, D)
        sweep = []
        est = max(2.0, c["kv_bytes"] / 2.5e6)  # us at 2.5 TB/s: sizes the replay count
        for cfg in configs:
            for s in split_options(B, c["max_ctx"], splits):
                fn = ours(c, cfg, s)
                try:
                    out = fn().float()
                    err = (out - ref).abs().max().item() if ref is not None else float("nan")
                    us = graph_us(fn, est)
                except Exception as e:  # noqa: BLE001  (a config that does not fit: say so)
                    log("config failed", cfg, s, type(e).__name__, str(e)[:120])
                    continue
                sweep.append(dict(cfg=list(cfg), splits=s, graph_us=us, err=err))
        sweep.sort(key=lambda r: r["graph_us"])
        top = sweep[0]
        cfg, s = tuple(top["cfg"]), top["splits"]
        row.update(best=top, auto_splits=auto, top5=sweep[:5],
                   by_splits={str(k): min(r["graph_us"] for r in sweep if r["splits"] == k)
                              for k in sorted({r["splits"] for r in sweep})},
                   by_cfg={str(k): min((r["graph_us"] for r in sweep if tuple(r["cfg"]) == k),
                                       default=None)
                           for k in configs},
                   max_err=max(r["err"] for r in sweep) if ref is not None else None)
        # eager (L2 flushed) and host cost: direct launch, JIT launch, layer 4's wrapper
        fn = ours(c, cfg, s)
        if s > 1:  # the same with the merge as a second kernel
            row["graph_unfused_us"] = graph_us(lambda: pd.paged_decode(
                c["q"], c["k"], c["v"], c["t"], c["n"], 0.125, None, s, config=cfg_dict(cfg),
                heads_first=cfg[3], fused_merge=False), est)

        def wrapper():
            return pa.paged_decode_attention(c["q"], c["k"], c["v"], c["t"], c["n"], 0.125)
        pd._DIRECT["on"] = True
        row["bench_direct_us"] = bench_us(fn)
        row["host_direct_us"] = host_us(fn) if B <= 8 else None
        pd._DIRECT["on"] = False
        row["bench_jit_us"] = bench_us(fn)
        row["host_jit_us"] = host_us(fn) if B <= 8 else None
        pd._DIRECT["on"] = True
        row["bench_wrapper_us"] = bench_us(wrapper)
        row["host_wrapper_us"] = host_us(wrapper) if B <= 8 else None
        row["graph_wrapper_us"] = graph_us(wrapper, est)
        if "kd" in c and B <= 8:
            row["host_sdpa_us"] = host_us(sdpa_fns(c)[row["sdpa"]])
        row["tbps_best"] = c["kv_bytes"] / top["graph_us"] / 1e6
        if args.old and n == "engine":
            row["old_graph_us"] = old_graph_us(args.old, c, auto, est)
            log(f"   old kernel (layer 4's old config, {auto} split): {row['old_graph_us']:.1f} us "
                f"= {c['kv_bytes'] / row['old_graph_us'] / 1e6:.2f} TB/s")
        rows.append(row)
        g = row.get("sdpa_graph_us")
        log(f"B={B:<3} n={n!s:<6} best {cfg} s={s:<2} graph {top['graph_us']:7.1f} us "
            f"({row['tbps_best']:.2f} TB/s) sdpa {g or float('nan'):7.1f} "
            f"ratio {(g or float('nan')) / top['graph_us']:.2f} | auto s={auto} | eager direct "
            f"{row['bench_direct_us']:.1f} jit {row['bench_jit_us']:.1f} wrapper "
            f"{row['bench_wrapper_us']:.1f} sdpa {row.get('sdpa_bench_us', float('nan')):.1f} | "
            f"host d/j/w/sdpa {row['host_direct_us']} {row['host_jit_us']} "
            f"{row['host_wrapper_us']} {row.get('host_sdpa_us')} | err {row['max_err']}")
        log("   by splits:", {k: round(v, 1) for k, v in row["by_splits"].items()})
        log("   by cfg:", {k: round(v, 1) for k, v in row["by_cfg"].items() if v is not None})
        results.append(row)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "sweep_paged.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
             "triton": triton.__version__, "rows": results}, indent=1, default=str))
    print("\nbatch context | best (BLOCK_N, warps, stages, heads_first) splits | graph us "
          "| sdpa graph | ratio | TB/s")
    for r in results:
        b = r["best"]
        g = r.get("sdpa_graph_us") or math.nan
        print(f"{r['batch']:5} {r['context']!s:>7} | {tuple(b['cfg'])!s:<22} {b['splits']:>3} | "
              f"{b['graph_us']:7.1f} | {g:7.1f} | {g / b['graph_us']:.2f} | {r['tbps_best']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
