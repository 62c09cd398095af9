"""Where a 2048-token prefill of Llama-3.2-1B's shape spends its time.

    python benchmarks/profile_prefill.py [--tokens 2048] [--json FILE] [--smoke]

Random bf16 weights (nothing downloaded). For the triton and torch backends: a torch.profiler
kernel table (GPU time per forward and share per kernel) and the GPU-busy fraction of the
forward's wall time. For the triton backend: the time with events (what
decode_prefill_engine.py measures), the host's enqueue time per forward, the same forward
replayed as one CUDA graph (no launch gaps: the GPU-only time), and variants with one op
swapped for torch's (attention -> SDPA, norms, RoPE, SiLU-mul) so each op's share shows as a
difference. Then layer 1's
FlashAttention kernel alone at the prefill's shapes and layout over a sweep of tile configs
and grid orders beside cuDNN (prefill_attention_sweep.py), and the four GEMMs alone (their
sum x layers is the matmul floor of the forward).
--smoke: a tiny fp32 model on the CPU (checks the script; no GPU figures).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import layer3_model as l3
from layer0_hardware import python_loop_ms
from layer3_model import bench as L3B
from layer3_model.backends import Ops, make_ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prefill_attention_sweep as PAS  # noqa: E402  (the attention sweep beside this script)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512)
CUDA = torch.cuda.is_available()


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def events_ms(fn: Callable[[], object], repeats: int = 10, warmup: int = 3) -> list[float]:
    """Per-call milliseconds (CUDA events around each call; perf_counter on the CPU)."""
    return [t * 1e3 for t in
            l3.time_fn(fn, warmup=warmup, repeats=repeats, device="cuda" if CUDA else "cpu")
            .samples]


def per_call_us(fn: Callable[[], object], n: int) -> float:
    """Microseconds per call over n back-to-back calls after one warm-up call (synchronized
    before and after, so it is the rate the host and GPU together sustain)."""
    fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    _sync()
    return (time.perf_counter() - t0) / n * 1e6


def host_ms(fn: Callable[[], object], repeats: int = 10) -> float:
    """Median host time to *enqueue* one call (the GPU idle at its start; no sync inside)."""
    out = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    _sync()
    return statistics.median(out)


def graph_ms(fn: Callable[[], object], repeats: int = 10) -> float | str:
    """Median ms of one CUDA-graph replay of fn (every launch gap removed), or why not."""
    if not CUDA:
        return "no CUDA"
    try:
        g, _ = l3.capture_graph(fn, warmup=2)
        return statistics.median(events_ms(g.replay, repeats))
    except Exception as err:  # noqa: BLE001  (report, don't stop the profile)
        return f"capture failed: {type(err).__name__}: {str(err)[:120]}"


def kernel_table(fn: Callable[[], object], n: int = 3) -> dict:
    """torch.profiler over n calls: per-kernel GPU us per call, share, and busy fraction."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    fn()
    _sync()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        _sync()
        wall = (time.perf_counter() - t0) / n * 1e3
    rows = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    rows.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in rows) / n / 1e3  # ms per call
    table = [{"kernel": e.key[:100], "per_call": e.count / n,
              "us_per_call": e.self_device_time_total / n,
              "share": e.self_device_time_total / n / 1e3 / total if total else 0.0}
             for e in rows]
    return {"wall_ms_profiled": wall, "gpu_ms": total,
            "gpu_busy": total / wall if wall else None,
            "kernels_per_call": sum(r["per_call"] for r in table), "kernels": table}


def _sdpa_attention(base: Ops) -> Callable:
    """Prefill attention through torch's SDPA (its FlashAttention-2) for one sequence from
    position 0 (the profile's case); anything else falls back to the op set's own."""
    def attention(q, k, v, ctx, cache, layer, scale, window):
        if ctx.num_seqs != 1 or ctx.max_query_len != ctx.max_seq_len or window is not None:
            return base.attention(q, k, v, ctx, cache, layer, scale, window)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], is_causal=True,
                                           scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    return attention


def _padded_attention(base: Ops) -> Callable:
    """The first prefill attention, before the token-major kernel (for a same-run
    before/after): k/v copied into zero-padded (B, S, Hkv, D) buffers, one output per
    sequence, concatenated."""
    from layer2_comm import kernels
    from layer3_model.backends import _keys_values

    def attention(q, k, v, ctx, cache, layer, scale, window):
        if ctx.max_query_len == 1 or window is not None:
            return base.attention(q, k, v, ctx, cache, layer, scale, window)
        keys, values = _keys_values(k, v, ctx, cache, layer)
        outs, start = [], 0
        for b, (n_q, n_kv) in enumerate(zip(ctx.query_lens_host, ctx.seq_lens_host,
                                            strict=True)):
            qb = q[start:start + n_q].transpose(0, 1)[None]
            ob = kernels.flash_attention(qb, keys[b:b + 1, :, :n_kv],
                                         values[b:b + 1, :, :n_kv], causal=True, scale=scale)
            outs.append(ob[0].transpose(0, 1))
            start += n_q
        return torch.cat(outs)
    return attention


def _views_attention(base: Ops) -> Callable:
    """The prefill attention before the host cuts (same-run before/after of those cuts):
    (1, H, n, D) views of each sequence's rows through the 4-D flash_attention entry."""
    from layer2_comm import kernels

    def attention(q, k, v, ctx, cache, layer, scale, window):
        if ctx.max_query_len == 1 or window is not None or not ctx.is_prefill:
            return base.attention(q, k, v, ctx, cache, layer, scale, window)
        out, start = torch.empty_like(q), 0

        def heads(x, rows):
            return x[rows].transpose(0, 1)[None]
        for n_q in ctx.query_lens_host:
            rows = slice(start, start + n_q)
            kernels.flash_attention(heads(q, rows), heads(k, rows), heads(v, rows), causal=True,
                                    scale=scale, out=heads(out, rows))
            start += n_q
        return out
    return attention


def _kernel_modules() -> tuple:
    """layer 1's norms, swiglu, flash_attention, rope_kv_write modules (the package's
    names for some of them are its functions)."""
    return tuple(importlib.import_module(f"layer1_kernels.{m}") for m in
                 ("norms", "swiglu", "flash_attention", "rope_kv_write"))


class before_host_cuts:
    """Context: the triton op set as it was before today's host cuts (RoPE and the cache write
    unfused, the views attention, triton's cdiv / next_power_of_2 in the launches)."""

    def __init__(self, net: l3.LlamaModel) -> None:
        self.net = net

    def __enter__(self):
        import triton
        nm, sw, fa_mod, rkw = _kernel_modules()
        self.saved = (self.net.ops, nm._launch_config, nm.cdiv, sw.cdiv, fa_mod.cdiv,
                      rkw.next_pow2)
        ops = self.net.ops
        self.net.ops = dataclasses.replace(ops, rope_write=None,
                                           attention=_views_attention(ops))

        def launch_config(hidden, max_block):  # uncached, through triton's helpers
            block = min(triton.next_power_of_2(hidden), triton.next_power_of_2(max_block))
            return (block, triton.cdiv(hidden, block),
                    16 if block >= 8192 else 8 if block >= 2048 else 4)
        nm._launch_config = launch_config
        nm.cdiv = sw.cdiv = fa_mod.cdiv = triton.cdiv
        rkw.next_pow2 = triton.next_power_of_2
        return self

    def __exit__(self, *exc):
        nm, sw, fa_mod, rkw = _kernel_modules()
        (self.net.ops, nm._launch_config, nm.cdiv, sw.cdiv, fa_mod.cdiv,
         rkw.next_pow2) = self.saved


def variants() -> dict[str, Ops]:
    """The triton op set, and copies with one op swapped (torch's, SDPA, the old path)."""
    tri, ref = make_ops("triton"), make_ops("torch")
    swap = dataclasses.replace
    return {
        "triton": tri,
        "triton, old padded attention": swap(tri, attention=_padded_attention(tri)),
        "triton, attention=SDPA": swap(tri, attention=_sdpa_attention(tri)),
        "triton, norm=torch": swap(tri, rms_norm=ref.rms_norm),
        "triton, rope=torch": swap(tri, rope=ref.rope),
        "triton, silu=torch": swap(tri, silu_and_mul=ref.silu_and_mul),
    }


def host_costs(net: l3.LlamaModel, tokens: int = 16, calls: int = 200) -> dict[str, float]:
    """Host microseconds per call of each op of a layer, at a size where the GPU's work is
    shorter than the host's (so calls / wall time is the issue rate), and of whole forwards."""
    dev, c = net.device, net.config
    layer, ops = net.layers[0], net.ops
    x = torch.randn(tokens, c.hidden_size, device=dev, dtype=net.dtype)
    qkv = layer.attn.qkv(x)
    q, k, v = layer.attn._qkv(x, ops)
    gu = layer.mlp.gate_up(x)
    cache = l3.ContiguousKVCache.for_model(c, 1, tokens, dtype=net.dtype, device=dev)
    ctx = cache.context([tokens], [0])
    ids = torch.randint(0, c.vocab_size, (tokens,), device=dev)
    old = _padded_attention(ops)
    cases = {
        "rms_norm": lambda: ops.rms_norm(x, layer.attn_norm.weight, 1e-5),
        "rms_norm + residual": lambda: ops.rms_norm(x, layer.attn_norm.weight, 1e-5, x),
        "F.linear (qkv)": lambda: layer.attn.qkv(x),
        "split + views (_qkv without matmul)": lambda: qkv.split([1, 1, qkv.shape[1] - 2], -1),
        "rope": lambda: ops.rope(q, k, net.cos, net.sin, ctx.positions),
        "cache.write": lambda: cache.write(0, k, v, ctx),
        "attention (strided, out=)": lambda: ops.attention(q, k, v, ctx, cache, 0,
                                                           layer.attn.scale, None),
        "attention (old: padded + cat)": lambda: old(q, k, v, ctx, cache, 0, layer.attn.scale,
                                                     None),
        "silu_and_mul": lambda: ops.silu_and_mul(gu),
        "one decoder layer": lambda: layer(x, x, ctx, cache, ops, net.cos, net.sin),
        "whole forward": lambda: net(ids, ctx, cache, last_only=True),
    }
    return {name: per_call_us(fn, calls if "forward" not in name else 20)
            for name, fn in cases.items()}


def cprofile_forward(fn: Callable[[], object], n: int = 5, top: int = 25) -> list[dict]:
    """cProfile over n forwards (synced before each): the functions with the most own time,
    as us per forward and calls per forward (cProfile's own overhead inflates them alike)."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    for _ in range(n):
        _sync()
        prof.enable()
        fn()
        prof.disable()
    _sync()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    rows = [{"fn": f"{k[2]} ({k[0].rsplit('/', 2)[-2:][-1]}:{k[1]})", "calls": v[1] / n,
             "own_us": v[2] / n * 1e6, "cum_us": v[3] / n * 1e6} for k, v in stats.items()]
    rows.sort(key=lambda r: -r["own_us"])
    total = sum(r["own_us"] for r in rows)
    return [{"total_own_us": total}] + rows[:top]


def launch_census(fn: Callable[[], object]) -> dict:
    """torch.profiler CPU side of one forward: driver/runtime launch calls (how many, host us
    each) and the ops with the most self CPU time."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    fn()
    _sync()
    with profile(activities=acts) as prof:
        fn()
        _sync()
    ev = prof.key_averages()
    launches = [e for e in ev if "LaunchKernel" in e.key or e.key in ("cudaLaunchKernelExC",
                                                                      "cuLaunchKernelEx")]
    ops = sorted((e for e in ev if e.self_cpu_time_total > 0),
                 key=lambda e: -e.self_cpu_time_total)
    return {"launch_calls": {e.key: {"count": e.count, "us_each": e.cpu_time_total / e.count}
                             for e in launches},
            "launches_total": sum(e.count for e in launches),
            "top_self_cpu": [{"op": e.key[:80], "count": e.count,
                              "self_us": e.self_cpu_time_total} for e in ops[:20]]}


def launch_paths(net: l3.LlamaModel, tokens: int = 16, calls: int = 300 if CUDA else 3
                 ) -> dict[str, float]:
    """Host us per call of one launch through each path, at a size whose GPU work is shorter
    than the host's: layer 1's wrapper vs the bare Triton launch vs torch ops, and the
    per-call costs of module calls and views that a layer makes many of."""
    from layer1_kernels import norms as nm
    dev, c = net.device, net.config
    x = torch.randn(tokens, c.hidden_size, device=dev, dtype=net.dtype)
    y = torch.empty_like(x)
    w = net.layers[0].attn_norm.weight
    lin = net.layers[0].attn.o_proj
    ident = torch.nn.Identity()
    blk = triton_next_pow2(c.hidden_size)

    def bare_norm():
        nm._norm_kernel[(tokens,)](x, x, x, w, x, y, c.hidden_size, 1e-5, IS_RMS=True,
                                   HAS_RESIDUAL=False, HAS_BIAS=False, BLOCK=blk, N_CHUNKS=1,
                                   num_warps=8)
    cases = {
        "kernels.rms_norm (wrapper)": lambda: nm.rms_norm(x, w, eps=1e-5),
        "bare _norm_kernel[grid]": bare_norm,
        "torch x + x": lambda: x + x,
        "torch.empty_like": lambda: torch.empty_like(x),
        "F.linear (o_proj weights)": lambda: F.linear(x, lin.weight),
        "nn.Linear module call": lambda: lin(x),
        "nn.Identity module call": lambda: ident(x),
        "3 views (x[a:b].transpose(0,1)[None])": lambda: x[0:8].transpose(0, 1)[None],
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream() if CUDA else None,
    }
    return {name: per_call_us(fn, calls) for name, fn in cases.items()}


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def host_profile(net: l3.LlamaModel, fwd: Callable[[], object]) -> dict:
    """Where the host's time goes in one prefill forward: enqueue ms,
    Python speed, cProfile, launch census, launch paths, op costs at T=16."""
    res = {"host_speed_ms": python_loop_ms(), "host_enqueue_ms": host_ms(fwd),
           "layers": net.config.num_hidden_layers}
    ops = net.ops
    try:  # the same forward with RoPE and the cache write as two ops again (before/after)
        net.ops = dataclasses.replace(ops, rope_write=None)
        fwd()
        res["host_enqueue_ms_unfused_rope_write"] = host_ms(fwd)
    finally:
        net.ops = ops
    with before_host_cuts(net):  # every cut of today undone, same run
        fwd()
        res["host_enqueue_ms_before_cuts"] = host_ms(fwd)
        res["events_ms_before_cuts"] = statistics.median(events_ms(fwd))
    res["events_ms"] = statistics.median(events_ms(fwd))
    res["host_enqueue_ms_again"] = host_ms(fwd)
    res["cprofile"] = cprofile_forward(fwd)
    res["census"] = launch_census(fwd)
    res["launch_paths_us"] = launch_paths(net)
    res["host_us_per_call_T16"] = host_costs(net)
    res["host_speed_ms_end"] = python_loop_ms()
    return res


def host_ab(net: l3.LlamaModel, fwd: Callable[[], object], rounds: int = 7) -> dict:
    """Enqueue ms before / after today's host cuts, interleaved (before, after, before, ...)
    so a host that speeds up or slows down during the run moves both alike; with the
    Python-loop time of each round."""
    with before_host_cuts(net):
        fwd()  # JIT of the before path
    fwd()
    _sync()
    before, after, loop = [], [], []
    for _ in range(rounds):
        loop.append(python_loop_ms())
        with before_host_cuts(net):
            before.append(host_ms(fwd, repeats=3))
        after.append(host_ms(fwd, repeats=3))
    return {"before_ms": before, "after_ms": after, "python_loop_ms": loop,
            "before_median_ms": statistics.median(before),
            "after_median_ms": statistics.median(after),
            "after_over_before": statistics.median(a / b for a, b in zip(after, before,
                                                                         strict=True))}


def print_host_profile(h: dict) -> None:
    n = h["layers"]
    print(f"host: python loop {h['host_speed_ms']:.1f} ms (end {h['host_speed_ms_end']:.1f}); "
          f"enqueue {h['host_enqueue_ms']:.3f} ms per forward = "
          f"{h['host_enqueue_ms'] / n * 1e3:.0f} us per layer (rope + cache write unfused: "
          f"{h['host_enqueue_ms_unfused_rope_write']:.3f} ms)")
    print(f"same run, before -> after today's host cuts: enqueue "
          f"{h['host_enqueue_ms_before_cuts']:.3f} -> {h['host_enqueue_ms_again']:.3f} ms; "
          f"eager forward (events) {h['events_ms_before_cuts']:.3f} -> {h['events_ms']:.3f} ms")
    cen = h["census"]
    print(f"launch calls per forward: {cen['launches_total']} "
          f"({cen['launches_total'] / n:.1f} per layer): " + ", ".join(
              f"{k} {v['count']}x {v['us_each']:.1f} us" for k, v in cen["launch_calls"].items()))
    print("top self CPU (torch.profiler, 1 forward): " + "; ".join(
        f"{r['op'][:40]} {r['count']}x {r['self_us']:.0f}us" for r in cen["top_self_cpu"][:12]))
    cp = h["cprofile"]
    print(f"cProfile (per forward, own time total {cp[0]['total_own_us']:.0f} us):")
    for r in cp[1:]:
        print(f"  {r['own_us']:7.0f} us own {r['cum_us']:8.0f} cum {r['calls']:6.0f}x  "
              f"{r['fn'][:70]}")
    print("launch paths, host us per call (T=16): " + ", ".join(
        f"{k} {v:.1f}" for k, v in h["launch_paths_us"].items()))
    print("ops, host us per call (T=16): " + ", ".join(
        f"{k} {v:.0f}" for k, v in h["host_us_per_call_T16"].items()))


def gemms(net: l3.LlamaModel, tokens: int) -> dict:
    """Each GEMM of one layer alone at the prefill's M (cuBLAS through F.linear)."""
    import triton.testing
    c = net.config
    x = torch.randn(tokens, c.hidden_size, device="cuda", dtype=net.dtype)
    layer = net.layers[0]
    mats = {"qkv": (x, layer.attn.qkv.weight), "o_proj": (x[:, :c.q_size].contiguous(),
            layer.attn.o_proj.weight), "gate_up": (x, layer.mlp.gate_up.weight),
            "down": (torch.randn(tokens, c.intermediate_size, device="cuda", dtype=net.dtype),
                     layer.mlp.down.weight)}
    out, per_layer = {}, 0.0
    for name, (a, w) in mats.items():
        ms = triton.testing.do_bench(lambda a=a, w=w: F.linear(a, w), warmup=10, rep=40,
                                     return_mode="median")
        out[name] = {"us": ms * 1e3, "tflops": 2 * a.shape[0] * a.shape[1] * w.shape[0] / ms
                     / 1e9}
        per_layer += ms
    out["all_layers_ms"] = per_layer * c.num_hidden_layers
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--host-ab", action="store_true",
                    help="only the interleaved before/after of today's host cuts (enqueue)")
    ap.add_argument("--host-only", action="store_true",
                    help="only where the host's time goes (enqueue, cProfile, launch census, "
                         "launch paths); no kernel tables, variants or sweeps")
    args = ap.parse_args(argv)
    shape, dtype, dev = dict(l3.LLAMA_3_2_1B), torch.bfloat16, "cuda"
    if args.smoke or not CUDA:
        shape.update(TINY)
        dtype, dev, args.tokens = torch.float32, "cpu", min(args.tokens, 64)
    net = l3.random_model(l3.ModelConfig.from_dict(shape), backend="triton", dtype=dtype,
                          device=dev)
    T = args.tokens
    ids = torch.randint(0, net.config.vocab_size, (T,), device=dev)
    cache = l3.ContiguousKVCache.for_model(net.config, 1, T, dtype=dtype, device=dev)
    ctx = cache.context([T], [0])
    flops = L3B.prefill_flops(net, T)
    peak = l3.load_ceilings("cuda").flops["bf16"] if CUDA else 1e11

    def fwd() -> torch.Tensor:
        return net(ids, ctx, cache, last_only=True)

    result: dict = {"tokens": T, "flops": flops, "peak_flops": peak, "profiles": {},
                    "variants": {}}
    if args.host_ab:
        with torch.no_grad():
            for _ in range(3):
                fwd()
            result["host_ab"] = ab = host_ab(net, fwd)
        print(f"host cuts, interleaved x{len(ab['before_ms'])}: enqueue before "
              f"{ab['before_median_ms']:.3f} ms, after {ab['after_median_ms']:.3f} ms "
              f"(after/before per round, median {ab['after_over_before']:.2f}); python loop "
              f"{min(ab['python_loop_ms']):.1f}-{max(ab['python_loop_ms']):.1f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1, default=str)
        return result
    if args.host_only:
        with torch.no_grad():
            for _ in range(3):  # JIT and allocator warm-up at this shape
                fwd()
            _sync()
            result["host"] = host_profile(net, fwd)
            print_host_profile(result["host"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1, default=str)
        return result
    with torch.no_grad():
        for name, ops in variants().items():
            net.ops = ops
            ms = events_ms(fwd)
            med = statistics.median(ms)
            result["variants"][name] = {"ms": med, "min_ms": min(ms), "MFU": flops / med
                                        / 1e3 / peak * 1e6}
            print(f"{name:28s} {med:8.3f} ms (min {min(ms):.3f})  MFU "
                  f"{result['variants'][name]['MFU']:.0%}", flush=True)
        net.ops = make_ops("triton")
        host, graph = host_ms(fwd), graph_ms(fwd)
        result.update(host_enqueue_ms=host, graph_replay_ms=graph)
        g = f"{graph:.3f} ms, MFU {flops / graph / 1e-3 / peak:.0%}" if isinstance(
            graph, float) else graph
        print(f"triton: host enqueue {host:.3f} ms per forward; one CUDA graph replay {g}")
        result["host_us_per_call_T16"] = host_costs(net)
        print("host us per call (T=16, GPU work shorter than the host's): " + ", ".join(
            f"{k} {v:.0f}" for k, v in result["host_us_per_call_T16"].items()))
        for backend in ("triton", "torch"):
            net.ops = make_ops(backend)
            prof = kernel_table(fwd)
            result["profiles"][backend] = prof
            print(f"\n{backend}: {prof['gpu_ms']:.3f} ms of kernels in "
                  f"{prof['wall_ms_profiled']:.3f} ms wall (profiled), "
                  f"{prof['kernels_per_call']:.0f} kernels per forward")
            for r in prof["kernels"][:14]:
                print(f"{r['us_per_call']:9.1f} us {r['share']:5.1%} {r['per_call']:5.0f}x "
                      f"{r['kernel'][:52]}")
        net.ops = make_ops("triton")
        if CUDA:
            result["gemms"] = gemms(net, T)
            print("\nGEMMs alone: " + ", ".join(
                f"{k} {v['us']:.0f} us {v['tflops']:.0f} TF/s"
                for k, v in result["gemms"].items() if isinstance(v, dict))
                  + f"; x layers {result['gemms']['all_layers_ms']:.3f} ms")
        if CUDA and not args.no_sweep:  # the attention alone at this length: every candidate
            rows = [r for d in (64, 128) for r in PAS.sweep_shape(T, d)]
            result["flash_sweep"] = rows
            PAS.print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return result


if __name__ == "__main__":
    main()
