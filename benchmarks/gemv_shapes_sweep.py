"""Layer 1's batch-1 decode GEMVs at every per-rank shape tensor parallelism gives them: a
launch-config sweep per projection against a device-to-device copy of the same bytes, then
each model layout's chain of projections with the old, the current and the swept configs.

    python benchmarks/gemv_shapes_sweep.py --out DIR [--budget-s 140] [--workers 12] [--quick]
        [--layouts 1B:1,8B:4]

Shapes (rank 0 of layer 5's Megatron shard, bf16, one row): Llama-3.1-8B at TP=1/2/4 and
Llama-3.2-1B at TP=1/2; per layer the qkv projection (gemv_rms_norm_rope: RMSNorm prologue,
RoPE and the cache write in its epilogue; q and kv heads split over the ranks), o_proj (plain
gemv, row-parallel: K = the rank's heads), gate_up (gemv_rms_norm, column-parallel: N = 2 F/p),
down (gemv_silu_mul, row-parallel: K = F/p) and once per step lm_head (gemv_rms_norm with fp32
logits, vocab-parallel: N = V/p). Every call is timed under CUDA-graph replay with PDL on (as
the engine launches them), over enough weight copies (> 256 MB) that none is in L2.

Per shape: the copy ceiling (`dst.copy_(w)` over the same rotated weights: TB/s counts read
plus written bytes, 2 B / t, the usual copy-bandwidth figure), then every candidate config:
us per call, TB/s (weight bytes / t) and the fraction of the copy's TB/s; each config's output
is checked against the unfused torch reference first (a wrong one is reported, never "best").
Then per layout one decoder layer's chain (qkv, o_proj, gate_up, down, with a small non-PDL
kernel after o_proj and down where the all-reduces are at TP > 1) over rotated layers, with
PDL's early trigger off and on: us per layer for the old
defaults, the current ones and the sweep's best.

Compiles (one per shape and config) run first in `--workers` processes that share Triton's
cache, so the sweep itself only loads them. Budget: configs of shapes still unswept when
`--budget-s` has passed are skipped (old and current defaults still timed). Writes
DIR/gemv_shapes.json after every shape; prints a line per measurement (flushed).
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

G = importlib.import_module("layer1_kernels.gemv")  # (the package's `gemv` is the function)
GR = importlib.import_module("layer1_kernels.gemv_rope")

T0 = time.monotonic()
BF16 = torch.bfloat16
EPS = 1e-5
ROTATE_BYTES = 256e6  # past the 50-60 MB L2 of an H100 / H200
DEV = "cuda"  # (a CPU smoke test sets "cpu": the kernels then run interpreted)

MODELS = {"8B": dict(H=4096, F=14336, hq=32, hkv=8, d=128, V=128256, tps=(4, 2, 1)),
          "1B": dict(H=2048, F=8192, hq=32, hkv=8, d=64, V=128256, tps=(2, 1))}

# (BLOCK_N, BLOCK_K, warps[, stages]) for gemv; (BLOCK_P pairs, BLOCK_K, warps[, stages]) for
# gemv_rope (two tiles). stages > 1: the K loop is pipelined through shared memory (cp.async),
# so small K tiles with many steps keep several tiles in flight per program.
GEMV_CANDIDATES = [
    (1, 1024, 2), (1, 2048, 4), (1, 4096, 4), (1, 4096, 8),
    (2, 1024, 4), (2, 2048, 4), (2, 2048, 8),
    (4, 512, 4), (4, 1024, 4), (4, 1024, 8), (4, 2048, 4), (4, 2048, 8), (4, 4096, 8),
    (8, 512, 4), (8, 1024, 4), (8, 1024, 8), (8, 2048, 8), (16, 512, 4), (16, 1024, 8),
    (2, 1024, 4, 3), (4, 256, 2, 4), (4, 512, 4, 3), (4, 512, 4, 4), (8, 256, 4, 4),
    (8, 512, 4, 3), (8, 512, 8, 4), (16, 256, 4, 3), (16, 512, 8, 3)]
ROPE_CANDIDATES = [
    (1, 512, 2), (1, 1024, 2), (1, 1024, 4), (1, 2048, 4), (1, 2048, 8), (1, 4096, 8),
    (2, 512, 2), (2, 1024, 4), (2, 1024, 8), (2, 2048, 4), (2, 2048, 8),
    (4, 512, 4), (4, 1024, 4), (4, 1024, 8), (8, 256, 4), (8, 512, 8),
    (1, 1024, 4, 3), (2, 512, 4, 3), (2, 512, 4, 4), (4, 256, 4, 4), (4, 512, 8, 3)]
QUICK_GEMV = [(2, 2048, 8), (4, 1024, 4), (4, 2048, 4), (8, 512, 4), (4, 512, 4, 3)]
QUICK_ROPE = [(1, 2048, 8), (2, 1024, 4), (2, 2048, 4), (2, 512, 4, 3)]

# What main chose before the shape sweep (gemv.TUNED / gemv_rope.TUNED and their defaults)
OLD_GEMV_TUNED = {(3072, 2048): (2, 2048, 8), (2048, 2048): (2, 2048, 8),
                  (16384, 2048): (2, 1024, 4), (2048, 8192): (8, 2048, 8),
                  (128256, 2048): (2, 2048, 8)}
OLD_ROPE_TUNED = {(3072, 2048): (2, 1024, 4)}


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def rank0_shapes(model: str, tp: int) -> dict[str, dict]:
    """Rank 0's projections under layer 5's shard (heads and FFN split, vocab padded)."""
    m = MODELS[model]
    hq, hkv = m["hq"] // tp, max(1, m["hkv"] // tp)
    f, v, H, d = -(-m["F"] // tp), -(-m["V"] // tp), m["H"], m["d"]
    return {"qkv": dict(op="rope", N=(hq + 2 * hkv) * d, K=H, heads=(hq, hkv, d)),
            "o_proj": dict(op="plain", N=H, K=hq * d),
            "gate_up": dict(op="rms", N=2 * f, K=H),
            "down": dict(op="silu", N=H, K=f),
            "lm_head": dict(op="logits", N=v, K=H)}


def old_config(s: dict) -> tuple[int, int, int]:
    n, k = s["N"], s["K"]
    if s["op"] == "rope":
        return OLD_ROPE_TUNED.get((n, k)) or (2, min(2048, pow2(k)), 4)
    return OLD_GEMV_TUNED.get((n, k)) or (4, min(2048, pow2(k)), 4)


def current_config(s: dict) -> tuple[int, int, int]:
    if s["op"] == "rope":
        return tuple(GR.config_for(s["N"], s["K"]))
    return tuple(G.config_for(s["N"], s["K"], 1))


def candidates(s: dict, quick: bool) -> list[tuple[int, int, int]]:
    rope = s["op"] == "rope"
    pool = (QUICK_ROPE if rope else QUICK_GEMV) if quick else (
        ROPE_CANDIDATES if rope else GEMV_CANDIDATES)
    out = [c for c in pool if c[1] <= pow2(s["K"])]
    for c in (old_config(s), current_config(s)):
        if c not in out:
            out.append(c)
    return out


class Case:
    """One projection's inputs and `copies` weight matrices; call(w, cfg) runs the op."""

    def __init__(self, s: dict, copies: int, fill: bool = True) -> None:
        dev = DEV
        self.s, N, K = s, s["N"], s["K"]
        make = (lambda *shape: torch.randn(*shape, device=dev, dtype=BF16)) if fill else (
            lambda *shape: torch.zeros(*shape, device=dev, dtype=BF16))
        self.ws = [make(N, K) * 0.02 if fill else make(N, K) for _ in range(copies)]
        self.x, self.res = make(1, K), make(1, K)
        self.nw = 1 + 0.1 * make(K)
        self.gu = make(1, 2 * K)
        if s["op"] == "rope":
            hq, hkv, d = s["heads"]
            ang = torch.arange(64, device=dev)[:, None] * 0.01 * torch.arange(
                1, d // 2 + 1, device=dev)[None, :]
            self.cos, self.sin = ang.cos().to(BF16), ang.sin().to(BF16)
            self.pos = torch.tensor([37], device=dev, dtype=torch.long)
            self.slots = torch.tensor([5], device=dev, dtype=torch.long)
            self.kc = torch.zeros(16, hkv, d, device=dev, dtype=BF16)
            self.vc = torch.zeros_like(self.kc)

    def call(self, w, cfg, caches=None):
        op = self.s["op"]
        if op == "plain":
            return G.gemv(self.x, w, config=cfg)
        if op == "silu":
            return G.gemv_silu_mul(self.gu, w, config=cfg)
        if op in ("rms", "logits"):
            return G.gemv_rms_norm(self.x, w, self.nw, EPS, self.res, config=cfg,
                                   out_dtype=torch.float32 if op == "logits" else None)[0]
        kc, vc = caches or (self.kc, self.vc)
        return GR.gemv_rms_norm_rope(self.x, w, self.nw, EPS, self.res, None, self.cos,
                                     self.sin, self.pos, kc, vc, self.slots, *self.s["heads"],
                                     config=cfg)[0]

    def reference(self, w):
        op = self.s["op"]
        if op == "plain":
            return G.gemv_reference(self.x, w)
        if op == "silu":
            return G.gemv_silu_mul_reference(self.gu, w)
        if op in ("rms", "logits"):
            y = G.gemv_rms_norm_reference(self.x, w, self.nw, EPS, self.res)[0]
            return y.float() if op == "logits" else y
        kc, vc = torch.zeros_like(self.kc), torch.zeros_like(self.vc)
        y = GR.gemv_rms_norm_rope_reference(self.x, w, self.nw, EPS, self.res, None, self.cos,
                                            self.sin, self.pos, kc, vc, self.slots,
                                            *self.s["heads"])[0]
        return y, kc, vc

    def error(self, cfg, ref) -> float:
        """Largest |out - ref| over max |ref| (cache rows included for the rope op)."""
        if self.s["op"] == "rope":
            kc, vc = torch.zeros_like(self.kc), torch.zeros_like(self.vc)
            outs = (self.call(self.ws[0], cfg, (kc, vc)), kc, vc)
        else:
            outs, ref = (self.call(self.ws[0], cfg),), (ref,)
        return max(((o.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-6)
                    ).item() for o, r in zip(outs, ref, strict=True))


def replay_us(fns: list, reps: int = 3, min_ms: float = 1.0) -> float:
    """Median us per call of `fns`, captured once into a CUDA graph and replayed."""
    from layer3_model import capture_graph

    def one() -> None:
        for f in fns:
            f()
    graph, _ = capture_graph(one, warmup=1)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    replays = max(3, min(500, math.ceil(min_ms / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * len(fns)))
    del graph
    return statistics.median(times)


# ---- compiling ahead, in parallel ---------------------------------------------------------
_WORKER: dict = {}


def _compile_job(job):
    """Worker: run (shape, cfg, early) once on zero inputs, so Triton compiles and caches it."""
    name, s, cfg, early = job
    t = time.monotonic()
    try:
        G.set_pdl(True, early=early)
        key = (s["op"], s["N"], s["K"])
        if _WORKER.get("key") != key:
            _WORKER.clear()
            _WORKER.update(key=key, case=Case(s, 1, fill=False))
        case = _WORKER["case"]
        case.call(case.ws[0], tuple(cfg))
        torch.cuda.synchronize()
        return name, tuple(cfg), early, time.monotonic() - t, None
    except Exception as e:  # noqa: BLE001 (reported per config, the sweep goes on)
        return name, tuple(cfg), early, time.monotonic() - t, repr(e)[:300]


def precompile(jobs: list, workers: int, limit_s: float) -> dict:
    """Compile `jobs` in `workers` spawned processes (sharing Triton's on-disk cache) within
    limit_s; the pool is gone (its GPU work too) before anything is timed. Returns
    {(name, cfg, early): error or None} of the jobs that finished."""
    if not jobs:
        return {}
    log(f"compiling {len(jobs)} kernels in {workers} processes")
    done, t = {}, time.monotonic()
    try:
        with mp.get_context("spawn").Pool(workers) as pool:  # exit: terminate
            it = pool.imap_unordered(_compile_job, jobs)
            while len(done) < len(jobs):
                try:  # (a timeout, not a plain loop: a dead worker would block it forever)
                    name, cfg, early, _, err = it.next(timeout=max(0.1, t + limit_s
                                                                   - time.monotonic()))
                except mp.TimeoutError:
                    log(f"  compile budget {limit_s:.0f} s spent at {len(done)}/{len(jobs)}: "
                        "the rest compile when first timed")
                    break
                done[(name, cfg, early)] = err
                if err:
                    log(f"  compile failed {name} {cfg} early={early}: {err}")
                if len(done) % 100 == 0:
                    log(f"  compiled {len(done)}/{len(jobs)}")
    except Exception as e:  # noqa: BLE001
        log(f"  compile pool failed: {e!r}")
    log(f"compiled {len(done)} in {time.monotonic() - t:.1f} s")
    return done


# ---- the sweep --------------------------------------------------------------------------------
def sweep_shape(name: str, s: dict, cfgs: list, full: bool, bad: dict) -> dict:
    nbytes = s["N"] * s["K"] * 2
    copies = max(2, math.ceil(ROTATE_BYTES / nbytes))
    case = Case(s, copies)
    dst = torch.empty_like(case.ws[0])
    copy_us = replay_us([lambda w=w: dst.copy_(w) for w in case.ws])
    copy_tbps = 2 * nbytes / copy_us / 1e6
    row = dict(name=name, op=s["op"], N=s["N"], K=s["K"], MB=nbytes / 1e6, copies=copies,
               copy_us=copy_us, copy_TBps=copy_tbps, old=old_config(s),
               current=current_config(s), configs=[])
    log(f"{name}: N={s['N']} K={s['K']} {nbytes / 1e6:.1f} MB x{copies}  copy {copy_us:.2f} us "
        f"= {copy_tbps:.2f} TB/s (2B/t)")
    ref = case.reference(case.ws[0])
    todo = cfgs if full else [c for c in cfgs if c in (row["old"], row["current"])]
    for cfg in todo:
        r = dict(config=cfg)
        if bad.get(cfg):
            r["error"] = "compile: " + bad[cfg]
        else:
            try:
                r["err"] = case.error(cfg, ref)
                if not r["err"] < 2e-2:
                    r["error"] = f"wrong result: rel err {r['err']:.3g}"
                else:
                    us = replay_us([lambda w=w, c=cfg: case.call(w, c) for w in case.ws])
                    tbps = nbytes / us / 1e6
                    r.update(us=us, TBps=tbps, frac=tbps / copy_tbps)
            except Exception as e:  # noqa: BLE001
                r["error"] = repr(e)[:300]
        row["configs"].append(r)
        tag = " (old)" if cfg == row["old"] else ""
        tag += " (current)" if cfg == row["current"] else ""
        if "us" in r:
            log(f"  {name} {cfg}: {r['us']:7.2f} us {r['TBps']:5.2f} TB/s "
                f"{100 * r['frac']:5.1f} % of copy{tag}")
        else:
            log(f"  {name} {cfg}: {r['error']}{tag}")
    timed = [r for r in row["configs"] if "us" in r]
    if timed:
        best = min(timed, key=lambda r: r["us"])
        row["best"] = best["config"]
        by = {tuple(r["config"]): r for r in timed}
        old, cur = by.get(tuple(row["old"])), by.get(tuple(row["current"]))
        log(f"  {name} BEST {best['config']} {best['us']:.2f} us {best['TBps']:.2f} TB/s "
            f"{100 * best['frac']:.1f} %"
            + (f" | old {old['us']:.2f} us {old['TBps']:.2f} TB/s" if old else "")
            + (f" | current {cur['us']:.2f} us" if cur else ""))
    return row


def chain(model: str, tp: int, picks: dict[str, dict[str, tuple]],
          deadline: float = math.inf) -> dict:
    """One decoder layer's projections (and an all-reduce stand-in at TP > 1) over rotated
    layers: us per layer for each set of configs in picks, with PDL's early trigger off and
    on."""
    shapes = {k: v for k, v in rank0_shapes(model, tp).items() if k != "lm_head"}
    layer_bytes = sum(v["N"] * v["K"] * 2 for v in shapes.values())
    layers = max(2, math.ceil(ROTATE_BYTES / layer_bytes))
    cases = {k: Case(v, layers) for k, v in shapes.items()}
    sep = torch.zeros(1, MODELS[model]["H"], device=DEV, dtype=BF16)
    out = dict(model=model, tp=tp, layer_MB=layer_bytes / 1e6, layers=layers, runs=[])
    early_opts = {"off": dict(early=False), "all": dict(early=True)}
    for label, cfgs in picks.items():
        for early, pdl in early_opts.items():
            if time.monotonic() - T0 > deadline:
                log(f"chain {model} TP={tp} {label} early={early}: skipped (deadline)")
                continue
            G.set_pdl(True, **pdl)
            fns = []
            for i in range(layers):
                for k in ("qkv", "o_proj", "gate_up", "down"):
                    fns.append(lambda c=cases[k], w=cases[k].ws[i], cfg=cfgs[k]: c.call(w, cfg))
                    if tp > 1 and k in ("o_proj", "down"):
                        fns.append(lambda: sep.add_(1.0))
            try:
                us = replay_us(fns) * len(fns) / layers
                r = dict(configs=label, early=early, us_per_layer=us,
                         TBps=layer_bytes / us / 1e6)
                log(f"chain {model} TP={tp} {label:8s} early={early:6s}: {us:7.2f} us/layer "
                    f"{r['TBps']:.2f} TB/s")
            except Exception as e:  # noqa: BLE001
                r = dict(configs=label, early=early, error=repr(e)[:300])
                log(f"chain {model} TP={tp} {label} early={early}: {r['error']}")
            out["runs"].append(r)
    G.set_pdl(True, early=False)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=140.0,
                    help="after this many seconds, remaining shapes time only old/current")
    ap.add_argument("--compile-s", type=float, default=70.0, help="limit of the compile phase")
    ap.add_argument("--chain-compile-s", type=float, default=25.0,
                    help="limit of the chains' compile phase (PDL early-trigger variants)")
    ap.add_argument("--deadline-s", type=float, default=math.inf,
                    help="no chain run starts after this many seconds from the start")
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--quick", action="store_true", help="a few configs per shape")
    ap.add_argument("--no-chain", action="store_true")
    ap.add_argument("--layouts", default=None,
                    help="model:tp pairs, comma-separated (e.g. 1B:1,8B:4); default: all")
    args = ap.parse_args(argv)
    layouts = [(m, tp) for m in MODELS for tp in MODELS[m]["tps"]]
    if args.layouts:
        wanted = {tuple(w.strip().split(":")) for w in args.layouts.split(",")}
        layouts = [(m, tp) for m, tp in layouts if (m, str(tp)) in wanted]
        if len(layouts) != len(wanted):
            ap.error(f"--layouts {args.layouts!r}: choose from "
                     + ", ".join(f"{m}:{tp}" for m in MODELS for tp in MODELS[m]["tps"]))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gemv_shapes.json"
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", flush=True)
        return 1
    G.set_pdl(True, early=False)
    shapes = {f"{m} TP={tp} {p}": s for m, tp in layouts for p, s in rank0_shapes(m, tp).items()}
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=importlib.import_module("triton").__version__,
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), shapes=[],
                  chains=[])
    log(f"{result['device']} torch {result['torch']} triton {result['triton']}; "
        f"{len(shapes)} shapes")
    jobs = [(n, s, c, False) for n, s in shapes.items() for c in candidates(s, args.quick)]
    bad: dict = {}
    for (n, c, _), err in precompile(jobs, args.workers, args.compile_s).items():
        bad.setdefault(n, {})[c] = err
    t_sweep = time.monotonic()
    for n, s in shapes.items():
        full = time.monotonic() - t_sweep < args.budget_s
        if not full:
            log(f"{n}: budget spent, old/current configs only")
        result["shapes"].append(sweep_shape(n, s, candidates(s, args.quick), full,
                                            bad.get(n, {})))
        torch.cuda.empty_cache()  # (the shape's weights, freed on return)
        path.write_text(json.dumps(result, indent=1))
    if not args.no_chain:
        by = {r["name"]: r for r in result["shapes"]}
        plans, cjobs = [], {}
        for m, tp in layouts:
            names = {p: f"{m} TP={tp} {p}" for p in ("qkv", "o_proj", "gate_up", "down")}
            picks = {"old": {p: tuple(by[n]["old"]) for p, n in names.items()}}
            for label in ("current", "best"):
                if all(label in by[n] for n in names.values()):
                    pick = {p: tuple(by[n][label]) for p, n in names.items()}
                    if pick not in picks.values():
                        picks[label] = pick
            plans.append((m, tp, picks))
            for c in picks.values():
                for p, n in names.items():
                    cjobs[(n, c[p])] = (n, shapes[n], c[p], True)
        precompile(list(cjobs.values()), args.workers, args.chain_compile_s)
        for m, tp, picks in plans:
            result["chains"].append(chain(m, tp, picks, args.deadline_s))
            torch.cuda.empty_cache()
            path.write_text(json.dumps(result, indent=1))
    print("\n== best per shape (us, TB/s, % of copy) vs old and current defaults", flush=True)
    for r in result["shapes"]:
        by = {tuple(c["config"]): c for c in r["configs"] if "us" in c}
        b, o, c = (by.get(tuple(r.get(k) or ())) for k in ("best", "old", "current"))

        def fmt(x):
            return f"{x['us']:7.2f} {x['TBps']:4.2f} {100 * x['frac']:5.1f}%" if x else "      -"
        print(f"{r['name']:22s} best {r.get('best')!s:16s} {fmt(b)} | old {r['old']!s:16s} "
              f"{fmt(o)} | current {fmt(c)}", flush=True)
    print("TUNED_BEST =", {f"{r['op']} {r['N']}x{r['K']}": r.get("best")
                           for r in result["shapes"]}, flush=True)
    path.write_text(json.dumps(result, indent=1))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
