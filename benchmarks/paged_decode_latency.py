"""Per-call latency of the two small kernels every decode step pays at batch 1: layer 1's paged
decode kernel and the greedy argmax over the vocabulary, before and after, in one run.

Paged decode, at the Llama-3.1-8B shape on one GPU (32 q / 8 kv heads, D 128), per rank at
TP=4 (8 / 2, D 128) and Llama-3.2-1B's (32 / 8, D 64); bf16, pages of 16, int64 tables and
lengths (the engine's), blocks shuffled across the cache, every sequence at the full context;
batch 1 and 32 x contexts 128, 256, 1024, 4096. Block tables as wide as the CUDA-graph runner's
for max_model_len = context + 16 ("tight", as the TP benchmark's engine) and, at batch 1,
8192 ("wide": a serving engine's; the split count is fixed when the graph is captured).

Each timing is CUDA-graph replay (what the engine pays), calls on rotating caches (at least
twice the L2 in all, where that takes at most 128 calls) so the keys come from DRAM as in a
step, "iso". At batch 1 also "eng": each call after a 64 MB GEMV launched as the engine's
qkv GEMV is (PDL), minus the GEMVs alone: the kernel as it runs inside a step. For the best
setting also without the early index loads.

  before: --before PATH, an earlier layer1_kernels/paged_decode.py with its own split rule and
          config, as layer 4 launched it (the one before each sequence was cut by its own
          length: `git show 73284c8~1:layer1_kernels/paged_decode.py > before.py`); without
          it, no before rows;
  after:  the current module's defaults (what layer 4 launches now);
  sweep:  (BLOCK_N, warps, stages) x shortest part x split count at each shape, the best per
          shape, and the single setting per (head dim, split or not) best over the shapes.

Engine: layer 4's engine decoding one sequence at the 1B and 8B shapes (random weights, CUDA
graphs), decode ms per step before (the earlier kernel and torch's argmax) and after.

Argmax: torch.argmax vs layer 1's split argmax (what layer 4's greedy sampling calls now) on
(1, 128256) and (32, 128256) fp32 rows, graph replay and eager (host launch included).

    python benchmarks/paged_decode_latency.py --out DIR [--budget-s 150] [--quick]

Prints progress (flushed), writes DIR/paged_decode_latency.json. Stops starting new work
past --budget-s (what was measured is written).
"""
# ruff: noqa: B023  (every lambda is timed inside its own loop iteration)
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import layer3_model as l3

pd = importlib.import_module("layer1_kernels.paged_decode")  # the package's name is the function
gemv_mod = importlib.import_module("layer1_kernels.gemv")
argmax_mod = importlib.import_module("layer1_kernels.argmax")

T0 = time.perf_counter()
PAGE = 16
SHAPES = {"8b_tp1": (32, 8, 128), "8b_tp4_rank": (8, 2, 128), "1b": (32, 8, 64)}
CONTEXTS = (128, 256, 1024, 4096)
WIDE = 8192
CANDIDATES = {  # (BLOCK_N, warps, stages) per head dim
    128: [(16, 2, 1), (16, 4, 1), (32, 2, 2), (32, 4, 1), (32, 4, 2), (64, 4, 1), (64, 4, 2),
          (64, 8, 2), (128, 8, 2)],
    64: [(16, 2, 1), (32, 2, 2), (32, 4, 1), (64, 4, 1), (64, 4, 2), (128, 4, 1), (128, 4, 2)],
}
MIN_PARTS = (16, 32, 64, 128, 256)
DEV, DTYPE = "cuda", torch.bfloat16  # --cpu-smoke: the interpreter, fp32, tiny shapes


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def load_before(path: str):
    spec = importlib.util.spec_from_file_location("layer1_kernels._paged_decode_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- timing ------------------------------------------------------------------------------------
def graph_us(fns: list, replays: int = 10) -> float:
    """us per round of fns (each called once a round), from a CUDA graph of one round."""
    if DEV == "cpu":  # the smoke run: the calls themselves, once
        t = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t) * 1e6
    def once():
        for f in fns:
            f()
    l3.warm_up(once, 2)
    graph, _ = l3.capture_graph(once, warmup=0)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(3):  # best of three batches of replays: the shared host's noise out
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / replays)
    del graph
    return best


def iso_us(fns: list) -> float:
    """us per call of a graph of the calls in fns (one each)."""
    return graph_us(fns) / len(fns)


# ---- cases -------------------------------------------------------------------------------------
def make_case(hq, hkv, d, B, ctx, width_tokens, l2_bytes, gen):
    """R rotations of (tables, the same lengths) over one shuffled pool of blocks."""
    need = -(-ctx // PAGE)
    width = -(-width_tokens // PAGE)
    kv_bytes = B * ctx * hkv * d * 2 * 2
    R = max(2, min(128, -(-2 * l2_bytes // kv_bytes)))
    total = R * B * need
    perm = torch.randperm(total, generator=gen, device=DEV)
    tables = torch.zeros(R, B, width, dtype=torch.int64, device=DEV)
    tables[:, :, :need] = perm.view(R, B, need)
    kc = torch.randn(total, PAGE, hkv, d, generator=gen, device=DEV, dtype=DTYPE)
    vc = torch.randn_like(kc)
    q = torch.randn(B, hq, d, generator=gen, device=DEV, dtype=DTYPE)
    lens = torch.full((B,), ctx, dtype=torch.int64, device=DEV)
    return dict(q=q, k=kc, v=vc, t=tables, n=lens, R=R, kv_bytes=kv_bytes,
                scale=1 / math.sqrt(d))


def reference(c) -> torch.Tensor:
    """float32 attention of the first two sequences (rotation 0)."""
    q, k, v, t, n = c["q"][:2], c["k"], c["v"], c["t"][0][:2], c["n"][:2]
    B, hq, d = q.shape
    hkv = k.shape[2]
    ctx = int(n[0])
    kk = k[t[:, :-(-ctx // PAGE)]].reshape(B, -1, hkv, d)[:, :ctx].float()
    vv = v[t[:, :-(-ctx // PAGE)]].reshape(B, -1, hkv, d)[:, :ctx].float()
    kk = kk.repeat_interleave(hq // hkv, 2).transpose(1, 2)
    vv = vv.repeat_interleave(hq // hkv, 2).transpose(1, 2)
    s = (q.float()[:, :, None] @ kk.transpose(-1, -2)) * c["scale"]
    return (s.softmax(-1) @ vv)[:, :, 0]


def calls(mod, c, splits=None, config=None):
    """One callable per rotation: mod.paged_decode on rotation r's tables."""
    return [lambda r=r: mod.paged_decode(c["q"], c["k"], c["v"], c["t"][r], c["n"], c["scale"],
                                         None, splits, config=config)
            for r in range(c["R"])]


def check(mod, c, splits=None, config=None) -> float:
    out = mod.paged_decode(c["q"], c["k"], c["v"], c["t"][0], c["n"], c["scale"], None, splits,
                           config=config)
    ref = reference(c)
    return float((out[:2].float() - ref).abs().max())


class Engine:
    """A 64 MB GEMV (x (1, 4096) @ w (8192, 4096)^T) launched as layer 1 launches the
    engine's (PDL): before each paged call, as the qkv GEMV is in a step."""

    def __init__(self):
        self.x = torch.randn(1, 4096, device=DEV, dtype=DTYPE)
        self.w = torch.randn(8192, 4096, device=DEV, dtype=DTYPE) * 0.01
        self.alone = {}

    def gemv(self):
        return gemv_mod.gemv(self.x, self.w)

    def us(self, fns: list) -> float:
        n = len(fns)
        if n not in self.alone:
            self.alone[n] = graph_us([self.gemv] * n, replays=5) / n
        pair = graph_us([f for fn in fns for f in (self.gemv, fn)], replays=5) / n
        return pair - self.alone[n]


# ---- the sweep ---------------------------------------------------------------------------------
@contextlib.contextmanager
def compile_only(*mods, workers: int = 14):
    """Inside the block every launch of mods' _paged_decode_kernel (none named: layer 1's)
    only compiles it (Triton's warmup), all of them at once on a thread pool (Triton's async
    compile mode: LLVM and ptxas run outside the GIL); the kernels are put back after."""
    from triton.runtime._async_compile import AsyncCompileMode
    mods = mods or (pd,)
    real = {m: m._paged_decode_kernel for m in mods}

    class Warm:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *a, **kw: self.kernel.warmup(*a, grid=grid, **kw)

    for m in mods:
        m._paged_decode_kernel = Warm(real[m])
    try:
        with AsyncCompileMode(ThreadPoolExecutor(workers)):
            yield
    finally:
        for m in mods:
            m._paged_decode_kernel = real[m]


def precompile(cases: list, before=None) -> None:
    """Every candidate config (and the before module's defaults) compiled at once."""
    with compile_only(pd, *([before] if before is not None else [])):
        for c in cases:
            d = c["q"].shape[-1]
            for cfg in CANDIDATES[d]:
                for early in (True, False):
                    conf = {"BLOCK_N": cfg[0], "num_warps": cfg[1], "num_stages": cfg[2],
                            "min_part": 16, "early_index": early}
                    for s in (1, 2, 64):
                        calls(pd, c, s, conf)[0]()
            if before is not None:
                for s in (1, 2, 64):
                    calls(before, c, s)[0]()


def sweep_case(c, B, ctx, width, sms, args) -> list[dict]:
    """Every candidate config x shortest part, the split count from the rule for that part
    (one timing per distinct (split count, device part length))."""
    d, hkv = c["q"].shape[-1], c["k"].shape[2]
    rows, timed = [], {}
    for cfg in CANDIDATES[d]:
        conf = {"BLOCK_N": cfg[0], "num_warps": cfg[1], "num_stages": cfg[2]}
        for mp in MIN_PARTS:
            s = pd.paged_decode_splits(B, hkv, width, sms, mp, head_dim=d)
            per = -(-ctx // s)  # keys a part, then whole BLOCK_N steps, then >= min_part
            part = max(mp, -(-per // cfg[0]) * cfg[0]) if s > 1 else 0
            key = (cfg, s, part)
            if key not in timed:
                timed[key] = round(iso_us(calls(pd, c, s, dict(conf, min_part=mp))), 2)
            rows.append(dict(cfg=list(cfg), min_part=mp, splits=s, part=part, us=timed[key]))
    return rows


def sync() -> None:
    if DEV != "cpu":
        torch.cuda.synchronize()


def paged(args, out: dict, path: Path) -> None:
    if DEV == "cpu":
        sms, l2 = 4, 1 << 16
    else:
        props = torch.cuda.get_device_properties(0)
        sms, l2 = props.multi_processor_count, props.L2_cache_size
    before = load_before(args.before) if args.before else None
    eng = Engine() if DEV != "cpu" else None
    gen = torch.Generator(device=DEV).manual_seed(0)
    plan = []
    for B in (1,) if args.quick else (1, 32):  # batch 1 (latency-bound) for every shape first
        for name, (hq, hkv, d) in SHAPES.items():
            for ctx in CONTEXTS:
                if args.quick and ctx not in (CONTEXTS[1], CONTEXTS[-1]):  # 256, 4096
                    continue
                widths = [("tight", ctx + 16)] + ([("wide", WIDE)] if B == 1 else [])
                plan.append((name, hq, hkv, d, B, ctx, widths))
    log(f"paged: {len(plan)} shapes; precompiling")
    if DEV != "cpu":
        probe = [make_case(hq, hkv, d, 1, 128, 144, 0, gen) for hq, hkv, d in
                 {(v[0], v[1], v[2]) for v in SHAPES.values()}]
        try:
            precompile(probe, before)
        except Exception as e:  # noqa: BLE001 - then each config compiles at its first call
            log(f"paged: precompiling failed ({type(e).__name__}: {e}); compiling as called")
        del probe
    log("paged: compiled")
    rows = out.setdefault("paged", [])
    best = bconf = None
    for name, hq, hkv, d, B, ctx, widths in plan:
        if time.perf_counter() - T0 > args.budget_s:
            log("paged: budget spent, stopping")
            out["paged_stopped_early"] = True
            break
        for wname, wtok in widths:
            try:
                best, bconf = case_rows(name, hq, hkv, d, B, ctx, wname, wtok, best, bconf,
                                        sms, l2, gen, before, eng, args, rows)
            except Exception as e:  # noqa: BLE001 - the other shapes (and the results) still count
                log(f"paged {name} B={B} ctx={ctx} {wname}: FAILED {type(e).__name__}: {e}")
                rows.append(dict(shape=name, batch=B, context=ctx, width=wname,
                                 error=f"{type(e).__name__}: {e}"))
            path.write_text(json.dumps(out, indent=1, default=str))  # what is measured so far
            if DEV != "cpu":
                torch.cuda.empty_cache()
    out["policy"] = policy(rows)
    log("paged: best single setting per (head dim, batch):", json.dumps(out["policy"]))


def case_rows(name, hq, hkv, d, B, ctx, wname, wtok, best, bconf, sms, l2, gen, before, eng,
              args, rows):
    """One shape at one table width: before, after, the sweep (tight), engine-like timings
    (batch 1). Returns the tight shape's best (setting, config) for the wide one after it."""
    c = make_case(hq, hkv, d, B, ctx, wtok, l2, gen)
    row = dict(shape=name, hq=hq, hkv=hkv, d=d, batch=B, context=ctx, width=wname,
               width_tokens=wtok, rotations=c["R"], kv_mb=round(c["kv_bytes"] / 1e6, 3))
    if before is not None:
        bs = before.paged_decode_splits(B, hkv, -(-wtok // PAGE) * PAGE, sms)
        row["before_splits"] = bs
        row["before_err"] = check(before, c)
        row["before_us"] = round(iso_us(calls(before, c)), 2)
    row["after_err"] = check(pd, c)
    row["after_splits"] = pd.paged_decode_splits(B, hkv, -(-wtok // PAGE) * PAGE, sms,
                                                 head_dim=d)
    row["after_us"] = round(iso_us(calls(pd, c)), 2)
    if args.quick:  # before / after only (the defaults)
        if B == 1 and eng is not None:
            sub = dict(c, R=min(c["R"], 32))
            if before is not None:
                row["before_eng_us"] = round(eng.us(calls(before, sub)), 2)
            row["after_eng_us"] = round(eng.us(calls(pd, sub)), 2)
        rows.append(row)
        log(f"paged {name} B={B} ctx={ctx} {wname}: "
            + " ".join(f"{k}={row[k]}" for k in row if k.endswith(("_us", "_splits"))))
        return best, bconf
    if wname == "tight":
        sw = sweep_case(c, B, ctx, -(-wtok // PAGE) * PAGE, sms, args)
        best = min(sw, key=lambda r: r["us"])
        row["sweep"] = sw
        row["best"] = best
        bconf = {"BLOCK_N": best["cfg"][0], "num_warps": best["cfg"][1],
                 "num_stages": best["cfg"][2], "min_part": best["min_part"]}
        row["best_err"] = check(pd, c, best["splits"], bconf)
        row["best_no_early_us"] = round(iso_us(calls(
            pd, c, best["splits"], dict(bconf, early_index=False))), 2)
    else:  # the tight shape's best setting, the split count from the rule at this width
        ws = pd.paged_decode_splits(B, hkv, -(-wtok // PAGE) * PAGE, sms,
                                    bconf["min_part"], head_dim=d)
        row["best_wide_splits"] = ws
        row["best_wide_us"] = round(iso_us(calls(pd, c, ws, bconf)), 2)
    if B == 1 and eng is not None:  # inside a step: after a PDL GEMV
        sub = dict(c, R=min(c["R"], 32))
        if before is not None:
            row["before_eng_us"] = round(eng.us(calls(before, sub)), 2)
        row["after_eng_us"] = round(eng.us(calls(pd, sub)), 2)
        bs_ = best["splits"] if wname == "tight" else row["best_wide_splits"]
        row["best_eng_us"] = round(eng.us(calls(pd, sub, bs_, bconf)), 2)
        row["best_no_early_eng_us"] = round(eng.us(calls(
            pd, sub, bs_, dict(bconf, early_index=False))), 2)
    rows.append(row)
    log(f"paged {name} B={B} ctx={ctx} {wname}: "
        + " ".join(f"{k}={row[k]}" for k in row if k.endswith(("_us", "_splits")))
        + (f" best={row['best']}" if "best" in row else ""))
    return best, bconf


def policy(rows: list[dict]) -> dict:
    """Per (head dim, batch): the (cfg, min_part) whose time relative to each shape's best,
    summed over the tight shapes, is least (split counts from the rule for that min_part);
    and "min_part_b1": the one shortest part best for both head dims at batch 1 (with each
    head dim's best config for it)."""
    res, scores = {}, {}
    for d in (64, 128):
        for B in (1, 32):
            group = [r for r in rows if "sweep" in r and r["d"] == d and r["batch"] == B]
            if not group:
                continue
            score = {}
            for r in group:
                bu = r["best"]["us"]
                for s in r["sweep"]:
                    score.setdefault((tuple(s["cfg"]), s["min_part"]), []).append(s["us"] / bu)
            full = {k: sum(v) / len(v) for k, v in score.items() if len(v) == len(group)}
            scores[(d, B)] = full
            top = sorted(full.items(), key=lambda kv: kv[1])[:6]
            res[f"d{d}_b{B}"] = [dict(cfg=list(k[0]), min_part=k[1], shapes=len(group),
                                      mean_vs_best=round(v, 3),
                                      worst_vs_best=round(max(score[k]), 3)) for k, v in top]
    joint = {}
    for mp in MIN_PARTS:
        per_d = {}
        for d in (64, 128):
            full = scores.get((d, 1), {})
            cands = [(v, k[0]) for k, v in full.items() if k[1] == mp]
            if cands:
                per_d[d] = min(cands)
        if len(per_d) == len({d for d, b in scores if b == 1}) and per_d:
            joint[mp] = per_d
    if joint:
        mp = min(joint, key=lambda m: sum(v for v, _ in joint[m].values()))
        res["min_part_b1"] = dict(min_part=mp, cfg={f"d{d}": list(c) for d, (_, c) in
                                                    joint[mp].items()},
                                  mean_vs_best={f"d{d}": round(v, 3) for d, (v, _) in
                                                joint[mp].items()})
    return res


def apply_policy(pol: dict):
    """The sweep's best settings as layer 1's defaults: the joint shortest part, batch 1's
    config for it on split launches, batch 32's best config on unsplit ones. Returns the
    undo."""
    real_cfg, real_mp = pd.default_config, pd.MIN_SPLIT_TOKENS
    joint = pol.get("min_part_b1")
    if joint:
        pd.MIN_SPLIT_TOKENS = int(joint["min_part"])

    def default_config(head_dim, dtype, splits=1, *rest):
        cfg = None
        if splits > 1 and joint and f"d{head_dim}" in joint["cfg"]:
            cfg = joint["cfg"][f"d{head_dim}"]
        elif splits == 1 and pol.get(f"d{head_dim}_b32"):
            cfg = pol[f"d{head_dim}_b32"][0]["cfg"]
        if cfg is None or dtype not in (torch.float16, torch.bfloat16):
            return real_cfg(head_dim, dtype, splits, *rest)
        return {"BLOCK_N": cfg[0], "num_warps": cfg[1], "num_stages": cfg[2],
                "min_part": pd.default_min_part()}

    pd.default_config = default_config

    def undo():
        pd.default_config, pd.MIN_SPLIT_TOKENS = real_cfg, real_mp
    return undo


# ---- the engine ---------------------------------------------------------------------------------
def engine_bench(args, out: dict, path: Path) -> None:
    """Layer 4's engine (CUDA graphs, triton backend, random bf16 weights) decoding one
    sequence: a 128-token prompt, up to 145 new tokens, max_model_len 304, before (the earlier
    kernel, its split rule and config, torch's argmax: layer 3's names pointed at them), the
    same with the split argmax, after (the current defaults), and (after a sweep) its best
    settings.
    Decode ms per step = (time for 145 tokens - time for 17) / 128, the best of 3."""
    import gc

    from layer5_parallel.planner import LLAMA_3_8B
    from layer5_parallel.runtime.random_source import random_net
    before = load_before(args.before) if args.before else None
    names = ("paged_decode", "paged_decode_splits", "argmax")
    now = {n: getattr(l3, n) for n in names}
    old = None if before is None else {
        "paged_decode": before.paged_decode, "paged_decode_splits": before.paged_decode_splits,
        "argmax": lambda x, **kw: torch.argmax(x, -1)}
    rows = out.setdefault("engine", [])
    shapes = (("llama-3.2-1b", l3.LLAMA_3_2_1B), ("llama-3.1-8b", LLAMA_3_8B))
    if DEV == "cpu":  # the smoke run: a tiny model, no graphs
        shapes = (("tiny", dict(l3.LLAMA_3_2_1B, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, vocab_size=300)),)
    for name, shape in shapes:
        if time.perf_counter() - T0 > args.budget_s:
            log("engine: budget spent, stopping")
            break
        try:
            rows.append(engine_shape(name, shape, out, before, now, old, random_net))
            log("engine", rows[-1])
        except Exception as e:  # noqa: BLE001 - the next shape (and the results) still count
            log(f"engine {name}: FAILED {type(e).__name__}: {e}")
            rows.append(dict(shape=name, error=f"{type(e).__name__}: {e}"))
        path.write_text(json.dumps(out, indent=1, default=str))  # what is measured so far
        gc.collect()
        if DEV != "cpu":
            torch.cuda.empty_cache()


def engine_shape(name, shape, out, before, now, old, random_net) -> dict:
    import gc

    import layer4_algorithms as l4
    import layer4_algorithms.kv.paged_attention as l4pa
    config = l3.ModelConfig.from_dict(shape)
    net = random_net(config, backend="triton", dtype=torch.bfloat16 if DEV != "cpu" else
                     torch.float32, device=DEV, seed=0)
    model = l3.Model(net)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (128,), generator=g).tolist()
    row = dict(shape=name)
    variants = [] if old is None else [
        ("before", old, None), ("before_split_argmax", dict(old, argmax=now["argmax"]), None)]
    variants += [("after", now, None)]
    if out.get("policy"):
        variants.append(("policy", now, out["policy"]))
    params = [l3.SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in (17, 145)]
    for variant, table, pol in variants:
        llm, restore = None, None
        try:
            for n, f in table.items():
                setattr(l3, n, f)
            l4pa._PLANS.clear()
            restore = apply_policy(pol) if pol else None
            llm = l4.LLM(model, cuda_graph=DEV != "cpu", num_blocks=64, max_num_seqs=1,
                         max_model_len=304)
            llm.generate([prompt], params[1])  # warm-up
            best, tokens = math.inf, None
            for _ in range(3 if DEV != "cpu" else 1):
                times = []
                for p in params:
                    sync()
                    t = time.perf_counter()
                    o = llm.generate([prompt], p)
                    sync()
                    times.append(time.perf_counter() - t)
                best = min(best, (times[1] - times[0]) * 1e3 / 128)  # 128 more decode steps
                tokens = o[0].outputs[0].token_ids
            row[f"{variant}_step_ms"] = round(best, 4)
            row[f"{variant}_tokens"] = tokens
        finally:
            if restore:
                restore()
            for n, f in now.items():
                setattr(l3, n, f)
            l4pa._PLANS.clear()
            del llm
            gc.collect()
    toks = [row.pop(f"{v}_tokens") for v, _, _ in variants]
    row["same_tokens"] = all(t == toks[0] for t in toks)
    for (v, _, _), t in zip(variants[1:], toks[1:], strict=True):  # greedy on random weights
        pairs = zip(toks[0], t, strict=False)  # meets near-ties: where do the tokens part?
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        row[f"{v}_first_diff_vs_{variants[0][0]}"] = first
    return row


# ---- argmax ------------------------------------------------------------------------------------
def argmax_bench(out: dict) -> None:
    rows = out.setdefault("argmax", [])
    for M in (1, 32):
        x = torch.randn(M, 128256, device=DEV, dtype=torch.float32)
        x[:, 77777] = 10.0  # ties: the first index wins
        x[:, 99999] = 10.0
        got = argmax_mod.argmax(x)
        same = bool(torch.equal(got, torch.argmax(x, -1)))
        xs = [torch.randn_like(x) for _ in range(8)]  # rotating rows (the step's fresh logits)
        t_torch = graph_us([lambda x=x: torch.argmax(x, -1) for x in xs]) / len(xs)
        t_ours = graph_us([lambda x=x: argmax_mod.argmax(x) for x in xs]) / len(xs)

        def eager(fn, n=200):
            fn()
            sync()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            return (time.perf_counter() - t) * 1e6 / n
        row = dict(rows=M, n=128256, equal_to_torch=same, torch_graph_us=round(t_torch, 2),
                   split_graph_us=round(t_ours, 2),
                   torch_eager_us=round(eager(lambda: torch.argmax(x, -1)), 2),
                   split_eager_us=round(eager(lambda: argmax_mod.argmax(x)), 2))
        rows.append(row)
        log("argmax", row)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--before", default=None,
                    help="an earlier layer1_kernels/paged_decode.py to time beside the current one")
    ap.add_argument("--quick", action="store_true",
                    help="no sweep: before / after at batch 1, contexts 256 and 4096")
    ap.add_argument("--only", default=None,
                    help="comma-separated parts to run: argmax, paged, engine (default all)")
    ap.add_argument("--engine-budget-s", type=float, default=None,
                    help="start no engine shape past this many seconds (default --budget-s)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="the script's paths on a CPU (Triton's interpreter, tiny shapes, fp32)")
    args = ap.parse_args(argv)
    if args.before and not Path(args.before).is_file():
        ap.error(f"--before {args.before}: no such file (an earlier paged_decode.py)")
    import triton
    out = dict(torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    if args.cpu_smoke:
        global DEV, DTYPE, SHAPES, CONTEXTS, CANDIDATES, MIN_PARTS, WIDE
        DEV, DTYPE, WIDE = "cpu", torch.float32, 64
        SHAPES, CONTEXTS = {"tiny": (4, 2, 16)}, (20, 40)
        CANDIDATES, MIN_PARTS = {16: [(16, 1, 1)]}, (16, 32)
        out["device"] = "cpu (interpreter smoke run)"
    elif not torch.cuda.is_available():
        raise SystemExit("paged_decode_latency.py times GPU kernels and needs a CUDA GPU")
    else:
        props = torch.cuda.get_device_properties(0)
        out.update(device=props.name, sms=props.multi_processor_count,
                   l2_mb=props.L2_cache_size / 2**20)
    log("device", out)
    path = Path(args.out) / "paged_decode_latency.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        parts = set((args.only or "argmax,paged,engine").split(","))
        if "argmax" in parts:
            argmax_bench(out)
        if "paged" in parts:
            paged(args, out, path)
        if "engine" in parts:
            if args.engine_budget_s is not None:
                args.budget_s = args.engine_budget_s
            engine_bench(args, out, path)
    finally:
        path.write_text(json.dumps(out, indent=1, default=str))
        log("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
