"""Per-call latency of layer 1's decode attention at small batch with wide tiles: one program
per (sequence, kv head, part) whose part is ONE loop step of C keys (C 128-512, 4-16 warps),
so a context of at most C keys is one part (no partial results, no merge) and a longer one
is cut into parts of C keys (merged in the launch, as now) -- against the configs launched
today, in one run.

At batch 1 the kernel is latency-bound: a few hundred keys, well under a megabyte, read by a
few dozen programs, each a chain of round trips (keys and values; with several parts the
partial results, the ticket, the merge's reads). A wide tile trades the merge's round trips
for more bytes a program (all of its kv head's keys and values in flight at once).

Shapes: Llama-3.2-1B (32 q / 8 kv heads, D 64) and Llama-3.1-8B per rank at TP=1, 2, 4 (32/8,
16/4, 8/2, D 128); bf16; contexts 128-2048; batch 1 (then 4). Two layouts:
  contiguous: layer 3's cache (batch, capacity, kv heads, D) read in place, as layer 3's fused
              decode launches it: "old" is its call today (backends.ATTENTION_CONFIG and its
              split count), capacity CAP keys for every context (one compile a config);
  paged:      layer 4's cache (pages of 16, shuffled blocks, tables as wide as context + 16):
              "old" is layer 1's defaults (what layer 4 launches), "old_ahead" the same with
              each part's first block ids read before the PDL wait (a launch without a
              "pipelined_ids" key gets PIPELINED_IDS["on"], True: ids in the loop, after the
              wait, a round trip more at one-step parts).
Every variant's output is checked against float32 attention first, at awkward lengths (1,
63, 65, 257, ...; GQA 4, D 64 and 128; a batch of mixed lengths in one launch).

Each timing: CUDA-graph replay of calls on rotating caches (about twice the L2 in all, at most
128 calls) so keys come from DRAM, per call ("iso"); at batch 1 also "eng": each call after a
PDL GEMV (as the qkv GEMV precedes attention in a step) minus the GEMVs alone; for the
contiguous layout also "engE": after a GEMV that triggers early (the attention launches
while it streams).

    python benchmarks/decode_attention_tiles.py --out DIR [--budget-s 80] [--cpu-smoke]
    python benchmarks/decode_attention_tiles.py --summarize DIR/decode_attention_tiles.json

Prints progress (flushed); writes DIR/decode_attention_tiles.json after every shape; stops
starting new work past --budget-s.
"""
# ruff: noqa: B023  (every lambda is timed inside its own loop iteration)
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import paged_decode_latency as PDL  # noqa: E402  (its timing helpers and paged cases)

import layer3_model as l3  # noqa: E402

pd = importlib.import_module("layer1_kernels.paged_decode")
T0 = time.perf_counter()
SHAPES = {"1b": (32, 8, 64), "8b_tp4": (8, 2, 128), "8b_tp2": (16, 4, 128),
          "8b_tp1": (32, 8, 128)}
CONTEXTS = (128, 256, 384, 512, 1024, 2048)
CAP = 2112  # the contiguous cache's capacity (keys): one compile serves every context
WIDE = {64: [(128, 4, 2), (256, 8, 1), (256, 8, 2), (512, 8, 1), (512, 16, 2)],  # C, warps,
        128: [(128, 4, 1), (128, 4, 2), (128, 8, 2), (256, 8, 1), (256, 16, 2)]}  # stages
CHECK_LENS = [1, 63, 65, 257, 129, 2047, 384, 512, 1000]
DEV, DTYPE = "cuda", torch.bfloat16


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def wide(c: int, w: int, s: int, cap: int, contiguous: bool):
    """(splits, config) of a wide-tile launch over `cap` keys of table capacity (stages > 1:
    the one step's keys and values copied to shared memory asynchronously, cp.async); paged:
    the first tile's block ids read before the PDL wait (not in the software pipeline)."""
    cfg = {"BLOCK_N": c, "num_warps": w, "num_stages": s, "min_part": c}
    if contiguous:
        cfg["trigger_early"] = True  # as layer 3's config
    else:
        cfg["pipelined_ids"] = False
    return max(1, min(64, -(-cap // c))), cfg


def variants(d: int, B: int, hkv: int, layout: str, cap: int) -> dict:
    """name -> (splits, config) (None, None: layer 1's own defaults)."""
    contiguous = layout == "contiguous"
    out = {}
    if contiguous:
        old_cfg = l3.backends.ATTENTION_CONFIG
        old_splits = l3.backends._num_splits(B, hkv, cap, torch.device(DEV))
        out["old"] = (old_splits, old_cfg)
    else:  # layer 1's defaults; and with the block ids read before the wait, where a launch
        # without a "pipelined_ids" key takes them in the software pipeline (PIPELINED_IDS on)
        out["old"] = (None, None)
        out["old_ahead"] = (None, {"pipelined_ids": False})
    for c, w, s in WIDE[d]:
        out[f"w{c}x{w}s{s}"] = wide(c, w, s, cap, contiguous)
    return out


# ---- cases -------------------------------------------------------------------------------------
def contiguous_case(hq, hkv, d, B, ctx, l2, gen, lens=None):
    """R rotations of a (B, CAP, kv heads, D) cache (views of one tensor), the same lengths."""
    kv_bytes = B * ctx * hkv * d * 2 * 2
    R = max(2, min(128, -(-2 * l2 // kv_bytes))) if lens is None else 1
    k = torch.randn(R * B, CAP, hkv, d, generator=gen, device=DEV, dtype=DTYPE)
    v = torch.randn_like(k)
    q = torch.randn(B, hq, d, generator=gen, device=DEV, dtype=DTYPE)
    n = torch.tensor(lens if lens is not None else [ctx] * B, dtype=torch.int64, device=DEV)
    return dict(q=q, k=[k[r * B:(r + 1) * B] for r in range(R)],
                v=[v[r * B:(r + 1) * B] for r in range(R)], n=n, R=R, kv_bytes=kv_bytes,
                scale=1 / math.sqrt(d))


def contiguous_calls(c, splits, cfg):
    return [lambda r=r: pd.paged_decode(c["q"], c["k"][r], c["v"][r], None, c["n"], c["scale"],
                                        None, splits, config=cfg) for r in range(c["R"])]


def paged_calls(c, splits, cfg):
    return PDL.calls(pd, c, splits, cfg)


def contiguous_reference(c) -> torch.Tensor:
    q, k, v, n = c["q"].float(), c["k"][0].float(), c["v"][0].float(), c["n"].tolist()
    B, hq, d = q.shape
    g = hq // k.shape[2]
    out = torch.zeros(B, hq, d, device=q.device)
    for b, m in enumerate(n):
        kk = k[b, :m].repeat_interleave(g, 1).transpose(0, 1)  # (hq, m, d)
        vv = v[b, :m].repeat_interleave(g, 1).transpose(0, 1)
        s = (kk @ q[b][:, :, None])[..., 0] * c["scale"]
        out[b] = (s.softmax(-1)[:, None, :] @ vv)[:, 0]
    return out


def paged_mixed_case(hq, hkv, d, lens, gen):
    """A paged case of mixed lengths (one rotation), tables wide enough for the longest."""
    width = -(-max(lens) // PDL.PAGE) + 1
    need = [-(-n // PDL.PAGE) for n in lens]
    total = sum(need) + 1
    perm = torch.randperm(total, generator=gen, device=DEV)
    t = torch.zeros(1, len(lens), width, dtype=torch.int64, device=DEV)
    at = 0
    for b, m in enumerate(need):
        t[0, b, :m] = perm[at:at + m]
        at += m
    kc = torch.randn(total, PDL.PAGE, hkv, d, generator=gen, device=DEV, dtype=DTYPE)
    return dict(q=torch.randn(len(lens), hq, d, generator=gen, device=DEV, dtype=DTYPE), k=kc,
                v=torch.randn_like(kc), t=t, n=torch.tensor(lens, device=DEV), R=1,
                scale=1 / math.sqrt(d), width=width * PDL.PAGE)


def paged_reference(c) -> torch.Tensor:
    q, k, v, t, n = c["q"].float(), c["k"].float(), c["v"].float(), c["t"][0], c["n"].tolist()
    B, hq, d = q.shape
    g = hq // k.shape[2]
    out = torch.zeros(B, hq, d, device=q.device)
    for b, m in enumerate(n):
        j = torch.arange(m, device=q.device)
        kk = k[t[b, j // PDL.PAGE], j % PDL.PAGE].repeat_interleave(g, 1).transpose(0, 1)
        vv = v[t[b, j // PDL.PAGE], j % PDL.PAGE].repeat_interleave(g, 1).transpose(0, 1)
        s = (kk @ q[b][:, :, None])[..., 0] * c["scale"]
        out[b] = (s.softmax(-1)[:, None, :] @ vv)[:, 0]
    return out


# ---- compile, check ----------------------------------------------------------------------------
def every_launch(gen):
    """(layout, d, name, splits, config, case) for one case per (layout, head dim): every
    variant -- the compiles the run needs."""
    seen = {}
    for hq, hkv, d in {(s[0], s[1], s[2]) for s in SHAPES.values()}:
        if d in seen:
            continue
        seen[d] = True
        lens = [n for n in CHECK_LENS if n <= CAP]
        cc = contiguous_case(hq, hkv, d, len(lens), 0, 0, gen, lens)
        pc = paged_mixed_case(hq, hkv, d, lens, gen)
        for name, v in variants(d, len(lens), hkv, "contiguous", CAP).items():
            yield "contiguous", d, name, *v, cc
        for name, v in variants(d, len(lens), hkv, "paged", pc["width"]).items():
            yield "paged", d, name, *v, pc


def call_once(layout, splits, cfg, c):
    if layout == "contiguous":
        return contiguous_calls(c, splits, cfg)[0]()
    return paged_calls(c, splits, cfg)[0]()


def precompile(gen) -> None:
    """Every launch the run makes compiled at once (paged_decode_latency.compile_only)."""
    with PDL.compile_only(pd):
        for layout, _d, _name, splits, cfg, c in every_launch(gen):
            call_once(layout, splits, cfg, c)


def check_all(gen, out: dict) -> bool:
    """Every variant at mixed awkward lengths in one launch (and again: the counters reset)
    against float32 attention: max abs error (bf16 inputs: < 2e-2 passes)."""
    ok = True
    res = out.setdefault("checks", [])
    refs = {}
    for layout, d, name, splits, cfg, c in every_launch(gen):
        key = (layout, d)
        if key not in refs:
            refs[key] = (contiguous_reference if layout == "contiguous" else paged_reference)(c)
        errs = []
        for _ in range(2):
            o = call_once(layout, splits, cfg, c)
            errs.append(float((o.float() - refs[key]).abs().max()))
        good = max(errs) < 2e-2 and all(math.isfinite(e) for e in errs)
        ok &= good
        res.append(dict(layout=layout, d=d, variant=name, splits=splits, max_err=max(errs),
                        ok=good))
        log(f"check {layout} D{d} {name} splits={splits}: max err {max(errs):.2e}"
            f" {'ok' if good else 'FAILED'}")
    return ok


# ---- timing ------------------------------------------------------------------------------------
class Engine(PDL.Engine):
    """paged_decode_latency's Engine (a 64 MB PDL GEMV before each call, the GEMVs alone
    subtracted); early: the GEMV triggers its dependents right after its first weight tile
    instead of after its K loop, so the attention launches while it streams."""

    def __init__(self, early: bool):
        super().__init__()
        self.early = early

    def us(self, fns: list) -> float:
        PDL.gemv_mod.set_pdl(True, early=self.early)
        try:
            return super().us(fns)
        finally:
            PDL.gemv_mod.set_pdl(True, early=False)


def time_case(name, hq, hkv, d, B, ctx, layout, l2, gen, eng, rows):
    if layout == "contiguous":
        c = contiguous_case(hq, hkv, d, B, ctx, l2, gen)
        mk, cap = contiguous_calls, CAP
    else:
        c = PDL.make_case(hq, hkv, d, B, ctx, ctx + 16, l2, gen)
        mk, cap = paged_calls, -(-(ctx + 16) // PDL.PAGE) * PDL.PAGE
    row = dict(shape=name, layout=layout, batch=B, context=ctx, rotations=c["R"],
               kv_kb=round(c["kv_bytes"] / 1e3, 1))
    sub = dict(c, R=min(c["R"], 32))
    for vname, v in variants(d, B, hkv, layout, cap).items():
        row[f"{vname}_us"] = round(PDL.iso_us(mk(c, *v)), 2)
        if B == 1 and eng is not None:
            row[f"{vname}_eng_us"] = round(eng[0].us(mk(sub, *v)), 2)
            if layout == "contiguous":  # the GEMV triggering early
                row[f"{vname}_engE_us"] = round(eng[1].us(mk(sub, *v)), 2)
    iso = {k[:-3]: u for k, u in row.items() if k.endswith("_us") and "_eng" not in k}
    best = min(iso, key=iso.get)
    row["best_iso"] = best
    row["best_iso_vs_old"] = round(iso[best] / iso["old"], 3)
    tail = ""
    for mode in ("eng", "engE"):
        engs = {k[:-len(mode) - 4]: u for k, u in row.items() if k.endswith(f"_{mode}_us")}
        if engs:
            be = min(engs, key=engs.get)
            row[f"best_{mode}"] = be
            row[f"best_{mode}_vs_old"] = round(engs[be] / engs["old"], 3)
            tail += f", {mode} {be} x{row[f'best_{mode}_vs_old']}"
    rows.append(row)
    log(f"{name} {layout} B={B} ctx={ctx}: "
        + " ".join(f"{k[:-3]}={u}" for k, u in row.items() if k.endswith("_us"))
        + f" | best iso {best} x{row['best_iso_vs_old']}" + tail)


def summarize(path: str) -> None:
    """A run's JSON as one line per (shape, layout, batch, context): us per call of old and of
    each wide variant, iso and inside a step (eng, engE), and the best of each against old."""
    out = json.loads(Path(path).read_text())
    print(f"device {out.get('device')}, checks ok: {out.get('checks_ok')}")
    for r in out.get("rows", []):
        if "error" in r:
            print(r["shape"], r["layout"], r["batch"], r["context"], "ERROR", r["error"])
            continue
        cols = []
        for mode, suffix in (("iso", "_us"), ("eng", "_eng_us"), ("engE", "_engE_us")):
            got = {k[:-len(suffix)]: u for k, u in r.items() if k.endswith(suffix)
                   and (mode != "iso" or "_eng" not in k)}
            if "old" in got:
                best = min(got, key=got.get)
                cols.append(f"{mode} old {got['old']:.2f} best {best} {got[best]:.2f} "
                            f"({got[best] / got['old']:.2f}x)")
        print(f"{r['shape']:7} {r['layout']:10} B{r['batch']} ctx {r['context']:5}: "
              + "; ".join(cols))


def main() -> int:
    global SHAPES, CONTEXTS, CAP, WIDE, CHECK_LENS, DEV, DTYPE
    if len(sys.argv) == 3 and sys.argv[1] == "--summarize":
        summarize(sys.argv[2])
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=80)
    ap.add_argument("--cpu-smoke", action="store_true", help="the interpreter, tiny shapes")
    ap.add_argument("--shapes", default=None, help="comma list of SHAPES names")
    args = ap.parse_args()
    out: dict = {"argv": sys.argv[1:]}
    if args.cpu_smoke:
        DEV, DTYPE = "cpu", torch.float32
        PDL.DEV, PDL.DTYPE = DEV, DTYPE
        SHAPES, CONTEXTS, CAP = {"tiny": (8, 2, 16)}, (20, 40), 80
        WIDE, CHECK_LENS = {16: [(32, 1, 1), (64, 1, 2)]}, [1, 15, 17, 33, 70]
        out["device"] = "cpu (interpreter smoke run)"
        l2, sms = 1 << 16, 4
    elif not torch.cuda.is_available():
        raise SystemExit("decode_attention_tiles.py times GPU kernels and needs a CUDA GPU")
    else:
        props = torch.cuda.get_device_properties(0)
        l2, sms = props.L2_cache_size, props.multi_processor_count
        out.update(device=props.name, sms=sms, l2_mb=l2 / 2**20, torch=torch.__version__)
    if args.shapes:
        SHAPES = {k: SHAPES[k] for k in args.shapes.split(",")}
    log("device", out)
    path = Path(args.out) / "decode_attention_tiles.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    try:
        if DEV != "cpu":
            try:
                precompile(gen)
            except Exception as e:  # noqa: BLE001 - then each compiles at its first call
                log(f"precompile failed ({type(e).__name__}: {e}); compiling as called")
            log("compiled")
        out["checks_ok"] = check_all(gen, out)
        path.write_text(json.dumps(out, indent=1, default=str))
        eng = (Engine(False), Engine(True)) if DEV != "cpu" else None
        rows = out.setdefault("rows", [])
        order = [("1b", "contiguous"), ("8b_tp4", "paged"), ("1b", "paged"),
                 ("8b_tp4", "contiguous"), ("8b_tp2", "paged"), ("8b_tp1", "paged"),
                 ("8b_tp2", "contiguous"), ("8b_tp1", "contiguous")]  # what the issues use first
        order = [o for o in order if o[0] in SHAPES] or [(n, lay) for n in SHAPES
                                                         for lay in ("contiguous", "paged")]
        plan = [(n, SHAPES[n], 1, ctx, lay) for n, lay in order for ctx in CONTEXTS]
        plan += [(n, s, 4, ctx, lay) for n, s in SHAPES.items() if n in ("1b", "8b_tp4")
                 for lay in ("paged",) for ctx in (256, 1024)]
        for name, (hq, hkv, d), B, ctx, layout in plan:
            if time.perf_counter() - T0 > args.budget_s:
                log("budget spent, stopping")
                out["stopped_early"] = True
                break
            try:
                time_case(name, hq, hkv, d, B, ctx, layout, l2, gen, eng, rows)
            except Exception as e:  # noqa: BLE001 - the other shapes still count
                log(f"{name} {layout} B={B} ctx={ctx}: FAILED {type(e).__name__}: {e}")
                rows.append(dict(shape=name, layout=layout, batch=B, context=ctx,
                                 error=f"{type(e).__name__}: {e}"))
            path.write_text(json.dumps(out, indent=1, default=str))
            if DEV != "cpu":
                torch.cuda.empty_cache()
    finally:
        path.write_text(json.dumps(out, indent=1, default=str))
        log("wrote", path)
    return 0 if out.get("checks_ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
