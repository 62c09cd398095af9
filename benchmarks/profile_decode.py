"""Where a batch-1 decode step of Llama-3.2-1B's shape (random bf16 weights) spends GPU time.

    python benchmarks/profile_decode.py [--eager] [--unfused] [--variants] [--sweep] [--json F]

Default: the step as the decode benchmark runs it (CudaGraphDecoder.step_greedy: the replay,
argmax inside it),
profiled with torch.profiler; the kernels of each step (graph replay included) are read from
the trace in order and grouped by (kernel, grid): per step count, mean time, achieved TB/s for
the GEMVs, and the mean idle gap before each (launch latency / dependency wait). The step's
span minus its kernels' busy time is the idle time the GPU spends between kernels.
--eager profiles eager steps instead; --unfused the general path (ops.decode off).
--variants times the benchmark's decode (tok/s, MBU) with the fused path's options toggled:
RoPE in the qkv GEMV epilogue, and PDL's early trigger. --pdl times it with decode
attention's trigger point moved (--attn-early sets it for the profile).
--sweep times the qkv (+RoPE) and o_proj GEMV tiles under graph replay (weights rotated past
L2)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import layer3_model as l3
from layer3_model import bench as L3B
from layer3_model.shapes import LLAMA_3_2_1B

K1 = l3.comm.kernels
ap = argparse.ArgumentParser()
ap.add_argument("--backend", default="triton")
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--eager", action="store_true", help="profile eager steps (no CUDA graph)")
ap.add_argument("--unfused", action="store_true", help="the general decode path")
ap.add_argument("--variants", action="store_true", help="time the fused path's options")
ap.add_argument("--more-variants", action="store_true",
                help="time step_greedy and attention split sizes")
ap.add_argument("--no-profile", action="store_true", help="skip the profile")
ap.add_argument("--attention", action="store_true",
                help="end-to-end tok/s with other attention split sizes / kernel configs")
ap.add_argument("--tiles", action="store_true",
                help="end-to-end tok/s with other gate_up / down GEMV tiles (gemv.TUNED)")
ap.add_argument("--sweep", action="store_true", help="qkv / o_proj GEMV tile sweep")
ap.add_argument("--early", action="store_true", help="PDL early trigger on for the profile")
ap.add_argument("--no-fuse-rope", action="store_true", help="RoPE in its own kernel")
ap.add_argument("--attn-early", action="store_true",
                help="decode attention lets the next kernel launch when it starts")
ap.add_argument("--pdl", action="store_true",
                help="end-to-end tok/s with each kernel's PDL trigger point moved")
ap.add_argument("--trials", default="all", choices=("all", "final"),
                help="--pdl's trials: all of them, or the final few (twice each, interleaved)")
ap.add_argument("--profile-best", action="store_true",
                help="after --pdl, profile the step again with its fastest trial's settings "
                     "(also with --no-profile)")
ap.add_argument("--json", default=None, help="write the figures here")
args = ap.parse_args()
cfg = l3.ModelConfig.from_dict(LLAMA_3_2_1B)
net = l3.random_model(cfg, backend=args.backend, dtype=torch.bfloat16, device="cuda")
BW = l3.load_ceilings("cuda").memory_bandwidth
fused_ops = net.ops
PAGED = sys.modules["layer1_kernels.paged_decode"]
GEMV = sys.modules["layer1_kernels.gemv"]
ATTN_DEFAULT = l3.backends.ATTENTION_CONFIG  # layer 3's own (the trials set theirs)
result: dict = {"device": torch.cuda.get_device_name(), "copy_bandwidth": BW}


def set_variant(fuse_rope: bool, early: bool) -> None:
    dk = fused_ops.decode
    net.ops = (fused_ops if dk is None else
               dataclasses.replace(fused_ops, decode=dataclasses.replace(dk, fuse_rope=fuse_rope)))
    K1.set_decode_pdl(True, early=early)


def set_triggers(attn_early: bool, attn_config: dict | None = None) -> None:
    """Where decode attention lets the next kernel launch (PDL): at its start or after its key
    loop; attn_config: its launch config (backends.ATTENTION_CONFIG; None: layer 1's
    default)."""
    l3.backends.ATTENTION_CONFIG = attn_config
    PAGED.TRIGGER_EARLY["on"] = attn_early


def shape_labels() -> dict:
    """grid size -> projection name, from the tiles the GEMVs launch with (batch 1)."""
    c = cfg
    shapes = {"qkv": (c.q_size + 2 * c.kv_size, c.hidden_size),
              "o_proj": (c.hidden_size, c.q_size),
              "gate_up": (2 * c.intermediate_size, c.hidden_size),
              "down": (c.hidden_size, c.intermediate_size),
              "lm_head": (c.vocab_size, c.hidden_size)}
    gemv_mod = sys.modules["layer1_kernels.gemv"]
    rope_mod = sys.modules["layer1_kernels.gemv_rope"]
    labels = {}
    for name, (n, k) in shapes.items():
        bn = (gemv_mod.TUNED.get((n, k)) or gemv_mod._default_config(n, k, 1))[0]
        labels[("_gemv_kernel", math.ceil(n / bn))] = (name, n * k * 2)
        if name == "qkv":
            bp = (rope_mod.TUNED.get((n, k)) or rope_mod._default_config(k))[0]
            labels[("_gemv_rope_kernel", math.ceil(n / 2 / bp))] = ("qkv+rope", n * k * 2)
    return labels


def trace_kernels(fn, steps: int) -> list[dict]:
    """The GPU kernels / copies fn() runs, `steps` times, in start order (from the trace)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    ev = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(ev, key=lambda e: e["ts"])


def profile_step() -> None:
    cache = l3.ContiguousKVCache.for_model(cfg, 1, 385, dtype=net.dtype, device="cuda")
    with torch.no_grad():
        net(torch.randint(0, 1000, (128,), device="cuda"), cache.context([128], [0]), cache,
            last_only=True)
        tok, pos = torch.tensor([5], device="cuda"), torch.tensor([128], device="cuda")
        if args.eager:
            def step():
                net(tok, cache.context([1], [int(pos)]), cache, last_only=True).argmax(-1)
        else:
            graph = l3.CudaGraphDecoder(net, cache, 1, greedy=True)

            def step():  # as the decode benchmark: the greedy pick inside the graph
                graph.step_greedy(tok, pos)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        ev = trace_kernels(step, args.steps)
    n = len(ev) // args.steps
    path = "unfused" if net.ops.decode is None else (
        "fused, rope in qkv" if net.ops.decode.fuse_rope else "fused, rope kernel")
    print(f"profile ({'eager' if args.eager else 'graph replay'}, {path}, PDL early "
          f"{sys.modules['layer1_kernels.gemv'].pdl_early()}, attention triggers early "
          f"{PAGED.TRIGGER_EARLY['on']}): {n} kernels/copies per step")
    labels = shape_labels()
    groups: dict = defaultdict(lambda: {"us": [], "gap": []})
    spans, busy = [], []
    for s in range(args.steps):
        step_ev = ev[s * n:(s + 1) * n]
        spans.append(step_ev[-1]["ts"] + step_ev[-1]["dur"] - step_ev[0]["ts"])
        prev_end, covered = None, 0.0  # (PDL overlaps kernels: count covered time once)
        for e in step_ev:
            grid = e.get("args", {}).get("grid", [0])
            key = (e["name"][:40], grid[0] if isinstance(grid, list) else grid)
            groups[key]["us"].append(e["dur"])
            end = e["ts"] + e["dur"]
            if prev_end is not None:
                groups[key]["gap"].append(e["ts"] - prev_end)
            covered += max(0.0, end - max(e["ts"], prev_end if prev_end is not None else 0.0))
            prev_end = max(prev_end or 0.0, end)
        busy.append(covered)
    span, work = statistics.median(spans), statistics.median(busy)
    print(f"step span {span:.1f} us (first kernel start .. last end), kernels busy {work:.1f} us, "
          f"idle between kernels {span - work:.1f} us")
    rows = []
    for (name, grid), g in sorted(groups.items(), key=lambda kv: -sum(kv[1]["us"])):
        label, nbytes = labels.get((name.split("(")[0].strip(), grid), (name, None))
        per_step = len(g["us"]) / args.steps
        mean = statistics.mean(g["us"])
        gap = statistics.mean(g["gap"]) if g["gap"] else 0.0
        tbps = nbytes / mean / 1e6 if nbytes else None
        rows.append({"kernel": label, "grid": grid, "per_step": per_step, "mean_us": mean,
                     "us_per_step": mean * per_step, "gap_before_us": gap, "TBps": tbps})
        print(f"{mean * per_step:8.1f} us/step {per_step:5.1f}x {mean:7.2f} us each, gap before "
              f"{gap:5.2f} us" + (f", {tbps:.2f} TB/s" if tbps else "") + f"  {label} [{grid}]")
    result.setdefault("profiles", []).append({"span_us": span, "busy_us": work, "kernels": rows})


def variants() -> None:
    moved = L3B.weight_bytes_read(net) + L3B.kv_bytes_per_position(net) * (128 + 128)
    result["variants"] = []
    for fuse_rope, early in ((False, False), (True, False), (False, True), (True, True)):
        set_variant(fuse_rope, early)
        spt = L3B.best_of(lambda: L3B.decode_seconds_per_token(net, prompt_len=128,
                                                               new_tokens=256))
        row = {"fuse_rope": fuse_rope, "pdl_early": early, "tokens_per_s": 1 / spt,
               "ms_per_token": spt * 1e3, "MBU": moved / spt / BW}
        result["variants"].append(row)
        print(f"variant rope-in-qkv={fuse_rope!s:5} pdl-early={early!s:5}: {1 / spt:7.1f} tok/s, "
              f"{spt * 1e3:.3f} ms/token, MBU {moved / spt / BW:.3f}")


def attention_variants() -> None:
    """The whole step (step_greedy) with layer 3's attention split size and kernel config."""
    moved = L3B.weight_bytes_read(net) + L3B.kv_bytes_per_position(net) * (128 + 128)
    b64 = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    for splits_min, config in ((None, None), (128, None), (None, b64), (128, b64)):
        l3.backends.ATTENTION_CONFIG = config
        try:
            with torch.no_grad():
                spt = greedy_seconds_per_token(splits_min)
        finally:
            l3.backends.ATTENTION_CONFIG = ATTN_DEFAULT
        splits_min = splits_min or l3.backends.MIN_SPLIT_TOKENS
        result.setdefault("attention", []).append(
            {"min_split_tokens": splits_min, "config": config, "tokens_per_s": 1 / spt,
             "MBU": moved / spt / BW})
        print(f"attention min_split_tokens={splits_min} config={config or 'default'}: "
              f"{1 / spt:7.1f} tok/s, MBU {moved / spt / BW:.3f}")


def greedy_seconds_per_token(splits_min: int | None = None, new_tokens: int = 256,
                             tokens: list | None = None) -> float:
    """decode_seconds_per_token's loop with step_greedy (argmax in the graph, no logits
    copy); splits_min: backends.MIN_SPLIT_TOKENS for the attention split count. tokens: a
    list that gets the first timed run's greedy tokens (the prompt is the same every call)."""
    old = l3.backends.MIN_SPLIT_TOKENS
    if splits_min is not None:
        l3.backends.MIN_SPLIT_TOKENS = splits_min
    try:
        cache = l3.ContiguousKVCache.for_model(cfg, 1, 128 + new_tokens + 1, dtype=net.dtype,
                                               device="cuda")
        prompt = torch.randint(0, cfg.vocab_size, (128,),
                               generator=torch.Generator().manual_seed(0)).cuda()
        tok = net(prompt, cache.context([128], [0]), cache, last_only=True).argmax(-1)
        pos = torch.tensor([128], device="cuda")
        graph = l3.CudaGraphDecoder(net, cache, 1, greedy=True)
        for _ in range(3):
            graph.step_greedy(tok, pos)
        best = float("inf")
        for _ in range(3):
            t = tok
            torch.cuda.synchronize()
            start = time.perf_counter()
            for i in range(new_tokens):
                t = graph.step_greedy(t, pos + i)
                if tokens is not None and best == float("inf"):
                    tokens.append(t)  # (a device tensor: no sync in the loop)
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - start) / new_tokens)
        return best
    finally:
        l3.backends.MIN_SPLIT_TOKENS = old


def timed_trial(label: str, first: list | None):
    """One trial of the whole step (greedy_seconds_per_token): (seconds a token, its greedy
    tokens, how many of them lead equal to `first`'s, all of them when first is None), or
    None where the option failed (a failing option must not cost the other trials)."""
    toks: list = []
    try:
        with torch.no_grad():
            spt = greedy_seconds_per_token(tokens=toks)
    except Exception as err:
        print(f"{label} FAILED: {type(err).__name__}: {str(err)[:300]}", flush=True)
        return None
    toks = torch.cat(toks).tolist()
    ref = toks if first is None else first
    same = next((i for i, (a, b) in enumerate(zip(toks, ref, strict=True)) if a != b), len(toks))
    return spt, toks, same


def more_variants() -> None:
    """step_greedy instead of step + argmax, and the attention's split size, (rope in qkv)."""
    moved = L3B.weight_bytes_read(net) + L3B.kv_bytes_per_position(net) * (128 + 128)
    for early in (False, True):
        set_variant(True, early)
        for splits_min in (128, 32, 64, 256, 1024):
            if early and splits_min != 128:
                continue
            with torch.no_grad():
                spt = greedy_seconds_per_token(splits_min)
            result.setdefault("greedy_variants", []).append(
                {"pdl_early": early, "min_split_tokens": splits_min, "tokens_per_s": 1 / spt,
                 "MBU": moved / spt / BW})
            print(f"step_greedy early={early!s:5} min_split_tokens={splits_min:4}: "
                  f"{1 / spt:7.1f} tok/s, {spt * 1e3:.3f} ms/token, MBU {moved / spt / BW:.3f}")


def pdl_variants() -> None:
    """The whole step (step_greedy) with the PDL trigger points moved, one after another
    (the first configuration again at the end: how much the figures drift)."""
    moved = L3B.weight_bytes_read(net) + L3B.kv_bytes_per_position(net) * (128 + 128)
    # (attention early[, the attention's config: layer 1's default unless a trial names one;
    # layer 3's ATTENTION_CONFIG is the last "final" trial's 64-key steps with the early
    # trigger])
    f = False
    trials = [(f,), (True,), (f,)]
    if args.trials == "final":  # all off, attention's early trigger (with 128 / 64 keys a
        # step): twice, interleaved
        b64 = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
        trials = [(f,), (True,), (True, b64)] * 2
    first = None  # the first trial's greedy tokens: moving a trigger changes no arithmetic,
    # so every trial must pick the same tokens (a kernel reading too early would not)
    best = None
    for trial in trials:
        attn_early = trial[0]
        set_triggers(*trial)
        got = timed_trial(f"pdl trial {trial}", first)
        if got is None:
            continue
        spt, toks, same = got
        first = toks if first is None else first
        row = {"attn_early": attn_early, "attn_config": trial[1:],
               "tokens_per_s": 1 / spt,
               "ms_per_token": spt * 1e3, "MBU": moved / spt / BW, "same_tokens_first": same}
        result.setdefault("pdl", []).append(row)
        if best is None or spt < best[0]:
            best = (spt, trial)
        print(f"pdl attention-early={attn_early!s:5}{trial[1:] or ''}: "
              f"{1 / spt:7.1f} tok/s, {spt * 1e3:.3f} ms/token, MBU {moved / spt / BW:.3f}, "
              f"first {same} of {len(toks)} tokens = the first trial's"
              + ("" if same == len(toks) or trial[1:] else
                 "  <-- DIFFER: a race?"),  # (another attention config rounds otherwise)
              flush=True)
    if best is None:
        return
    result["pdl_best"] = best[1]
    print(f"pdl best: {best[1]} {1 / best[0]:.1f} tok/s", flush=True)
    if args.profile_best:
        set_triggers(*best[1])
        profile_step()
    set_triggers(args.attn_early, attn_config=ATTN_DEFAULT)


def tiles() -> None:
    """The whole step timed (step_greedy) with one projection's tile changed at a time."""
    tuned = sys.modules["layer1_kernels.gemv"].TUNED
    rope_tuned = sys.modules["layer1_kernels.gemv_rope"].TUNED
    c = cfg
    moved = L3B.weight_bytes_read(net) + L3B.kv_bytes_per_position(net) * (128 + 128)
    shapes = {"down": (c.hidden_size, c.intermediate_size),
              "gate_up": (2 * c.intermediate_size, c.hidden_size)}
    shapes["qkv+rope"] = (c.q_size + 2 * c.kv_size, c.hidden_size)
    trials = ([] if args.attention else [("down", None)]) + [  # (--attention: the baseline)
        ("qkv+rope", (1, 2048, 8)), ("down", (4, 2048, 8)), ("down", (2, 2048, 4)),
        ("gate_up", (4, 1024, 4)), ("down", (16, 1024, 8)), ("gate_up", (2, 2048, 8))]
    for name, tile in trials:
        key, table = shapes[name], (rope_tuned if name == "qkv+rope" else tuned)
        old = table[key]
        if tile is not None:
            table[key] = tile
        try:
            with torch.no_grad():
                spt = greedy_seconds_per_token()
        finally:
            table[key] = old
        result.setdefault("tiles", []).append({"proj": name, "tile": tile or old,
                                               "tokens_per_s": 1 / spt, "MBU": moved / spt / BW})
        print(f"tiles {name} {tile or old}{' (now)' if tile is None else ''}: {1 / spt:7.1f} "
              f"tok/s, MBU {moved / spt / BW:.3f}")


def sweep() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from decode_kernels_bench import graph_us, weights
    c = cfg
    n_qkv, k = c.q_size + 2 * c.kv_size, c.hidden_size
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    kc = torch.zeros(64, c.num_key_value_heads, c.head_dim, device="cuda", dtype=torch.bfloat16)
    pos = torch.tensor([7], device="cuda")
    cos, sin = net.cos, net.sin
    heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    out = result.setdefault("sweep", {})
    for early in (False, True):
        K1.set_decode_pdl(True, early=early)
        ws = weights(n_qkv, k)
        for cfg_ in [(1, 2048, 8), (1, 2048, 4), (2, 1024, 4)]:
            us = graph_us([lambda w=w, c_=cfg_: K1.gemv_rms_norm_rope(
                x, w, nw, 1e-5, x, None, cos, sin, pos, kc, kc, pos, *heads, config=c_)
                for w in ws])
            out[f"qkv_rope {cfg_} early={early}"] = us
            print(f"qkv+rope {cfg_} early={early}: {us:.2f} us, "
                  f"{n_qkv * k * 2 / us / 1e6:.2f} TB/s")
        ws = weights(c.hidden_size, c.q_size)
        for cfg_ in [(2, 2048, 8), (1, 2048, 4), (4, 1024, 8)]:
            us = graph_us([lambda w=w, c_=cfg_: K1.gemv(x, w, config=c_) for w in ws])
            out[f"o_proj {cfg_} early={early}"] = us
            print(f"o_proj {cfg_} early={early}: {us:.2f} us, "
                  f"{c.hidden_size * c.q_size * 2 / us / 1e6:.2f} TB/s")
        del ws
    K1.set_decode_pdl(True, early=False)


if args.unfused:
    net.ops = dataclasses.replace(fused_ops, decode=None)
else:
    set_variant(not args.no_fuse_rope, args.early)
set_triggers(args.attn_early, attn_config=ATTN_DEFAULT)
if not args.no_profile:
    profile_step()
for wanted, part in ((args.pdl, pdl_variants),
                     (args.variants, variants), (args.more_variants, more_variants),
                     (args.attention, attention_variants), (args.tiles, tiles),
                     (args.sweep, sweep)):
    if wanted:
        part()
if args.json:
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
