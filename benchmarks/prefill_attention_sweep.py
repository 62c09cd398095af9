"""A lone prompt's prefill attention, every candidate in one table: layer 1's flash kernel at
tile configs in both grid orders (the default one and HEADS_FIRST), layer 1's
cudnn_attention_tokens (cuDNN through aten's op), and PyTorch SDPA restricted to its cuDNN and
its FlashAttention-2 backends, at 512 / 2048 / 4096 tokens, D 64 (Llama-3.2-1B) and 128
(Llama-3.1-8B), 32 query / 8 kv heads, bf16, causal.

The serving layout: q, k and v are strided views of one fused (T, (Hq + 2 Hkv) D) qkv output,
as layer 3's prefill hands them over. Each variant's output is checked against layer 1's
fp32 reference first (rel_err; a variant off by more than 1e-2 is marked WRONG and not
ranked). Timing: CUDA-graph replays of REPS back-to-back calls (GPU time only: a 512-token
call is shorter than its host launch path), median of do_bench, per call. The table gives
us, TFLOP/s (causal: 2 * Hq * T^2 * D) and the ratio to SDPA's cuDNN backend in the same run,
and per shape what the best flash variant and cuDNN would save a prefill (x layers).

    python benchmarks/prefill_attention_sweep.py --out DIR [--budget-s 120] [--quick]
        [--tokens 512 2048 4096] [--dims 64 128]
    python benchmarks/prefill_attention_sweep.py --cpu-smoke   # the script on tiny CPU shapes

Writes DIR/prefill_attention_sweep.json after every shape; starts no new shape past
--budget-s. profile_prefill.py runs the same sweep at its prompt length.
"""
from __future__ import annotations

import argparse
import importlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from layer1_kernels import cudnn_attention_tokens
from layer1_kernels.bench import median_seconds

fa = importlib.import_module("layer1_kernels.flash_attention")  # the module, not the function
HEADS = (32, 8)
LAYERS = {64: ("1B", 16), 128: ("8B", 32)}  # the model each head dim stands for, its layers
REPS = 20  # calls per graph replay
#: Tile configs (BLOCK_M, BLOCK_N, num_warps, num_stages) tried beside the table's pick.
TILES = {64: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3), (64, 32, 4, 3),
              (128, 128, 8, 3), (64, 128, 4, 2), (128, 32, 8, 3), (64, 64, 4, 4)],
         128: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 32, 4, 3),
               (128, 128, 8, 2), (64, 128, 4, 2), (128, 32, 8, 2)]}
QUICK = 3  # --quick: the first QUICK tiles of each list
START = time.perf_counter()


def fused_rows(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (T, Hq, D), k and v (T, Hkv, D) as views of one fused qkv output."""
    gen = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen, device=device).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def _config(tile: tuple[int, int, int, int], heads_first: bool) -> dict:
    m, n, w, s = tile
    return {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s,
            "HEADS_FIRST": heads_first}


def _name(cfg: dict) -> str:
    order = " heads-first" if cfg["HEADS_FIRST"] else ""
    return (f"flash {cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} "
            f"s{cfg['num_stages']}{order}")


def _sdpa(backend_name: str) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v):
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(*(t.unsqueeze(0).transpose(1, 2)
                                                 for t in (q, k, v)),
                                               is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1)
    return run


def variants(t: int, d: int, dtype: torch.dtype, quick: bool, cuda: bool) -> list[dict]:
    """name, kind, config and fn(q, k, v) -> (T, Hq, D) of every candidate at (t, d)."""
    default = fa._pick_config(t, d, dtype, True)
    base = {**default, "HEADS_FIRST": False}
    tiles = TILES.get(d, [])[:QUICK if quick else None] if cuda else [(16, 16, 1, 1),
                                                                     (32, 16, 1, 1)]
    configs = [base, {**base, "HEADS_FIRST": True}]
    for tile in tiles:
        for order in (False, True):
            cfg = _config(tile, order)
            if cfg not in configs:
                configs.append(cfg)
    impl = "auto" if cuda else "triton"
    out = []
    for cfg in configs:
        def flash(q, k, v, cfg=cfg):
            return fa.flash_attention_tokens(q, k, v, torch.empty_like(q), config=cfg,
                                             impl=impl)
        label = _name(cfg) + (" (default)" if cfg == base else "")
        out.append({"name": label, "kind": "flash", "config": cfg, "fn": flash})
    out.append({"name": "cudnn_attention_tokens (aten op)", "kind": "cudnn",
                "fn": cudnn_attention_tokens})
    out.append({"name": "SDPA cuDNN backend", "kind": "sdpa_cudnn",
                "fn": _sdpa("CUDNN_ATTENTION")})
    out.append({"name": "SDPA flash backend", "kind": "sdpa_flash",
                "fn": _sdpa("FLASH_ATTENTION")})
    return out


def _graph_seconds(fn: Callable[[], object]) -> tuple[float, str]:
    """Per-call seconds: REPS calls captured in one CUDA graph, do_bench's median of its
    replays / REPS; eager do_bench where capture fails (said in the second value)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(REPS):
                fn()
        return median_seconds(g.replay) / REPS, "graph"
    except Exception as e:  # noqa: BLE001  (report it, time eagerly instead)
        torch.cuda.synchronize()
        return median_seconds(fn), f"eager ({type(e).__name__}: {str(e)[:60]})"


def sweep_shape(t: int, d: int, *, heads: tuple[int, int] = HEADS, quick: bool = False,
                cuda: bool = True) -> list[dict]:
    """Every variant at (t, d) and heads (Hq, Hkv): checked against the fp32 reference, then
    timed."""
    hq, hkv = heads
    dtype = torch.bfloat16 if cuda else torch.float32
    dev = "cuda" if cuda else "cpu"
    q, k, v = fused_rows(t, hq, hkv, d, dtype, dev, seed=t + d)
    four = [x.transpose(0, 1)[None] for x in (q, k, v)]
    ref = fa.flash_attention_reference(*four, causal=True)[0].transpose(0, 1).float()
    flops = 2.0 * hq * t * t * d  # causal: half of 4 * Hq * T^2 * D
    rows = []
    for var in variants(t, d, dtype, quick, cuda):
        row = {"tokens": t, "head_dim": d, "name": var["name"], "kind": var["kind"],
               "config": var.get("config")}
        try:
            if not cuda and var["kind"] != "flash":
                raise RuntimeError("needs CUDA")
            out = var["fn"](q, k, v)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            row.update(rel_err=err, ok=err < 1e-2, out_contiguous=out.is_contiguous())
            if cuda:
                sec, how = _graph_seconds(lambda fn=var["fn"]: fn(q, k, v))
            else:
                t0 = time.perf_counter()
                var["fn"](q, k, v)
                sec, how = time.perf_counter() - t0, "cpu (interpreted)"
            row.update(us=sec * 1e6, tflops=flops / sec / 1e12, timing=how)
        except Exception as e:  # noqa: BLE001  (out of shared memory, no cuDNN, ...)
            row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        rows.append(row)
    cudnn = next((r["us"] for r in rows if r["kind"] == "sdpa_cudnn" and "us" in r), None)
    for r in rows:
        if cudnn and "us" in r:
            r["vs_sdpa_cudnn"] = cudnn / r["us"]  # > 1: faster than SDPA's cuDNN
    return rows


def verdict(rows: list[dict]) -> dict:
    """Per shape: the default flash variant, the best correct flash variant, cuDNN (ours),
    and what each would save a prefill of the model this head dim stands for."""
    good = [r for r in rows if r.get("ok") and "us" in r]
    if not good:
        return {}
    t, d = rows[0]["tokens"], rows[0]["head_dim"]
    model, layers = LAYERS.get(d, ("?", 1))
    flash = [r for r in good if r["kind"] == "flash"]
    default = next((r for r in flash if r["name"].endswith("(default)")), None)
    best = min(flash, key=lambda r: r["us"]) if flash else None
    cudnn = next((r for r in good if r["kind"] == "cudnn"), None)
    out = {"tokens": t, "head_dim": d, "model": model, "layers": layers}
    if default:
        out["default_us"] = default["us"]
    if best:
        out.update(best_flash=best["name"], best_flash_us=best["us"])
    if cudnn:  # (a non-contiguous output would cost the model a copy before o_proj)
        out.update(cudnn_us=cudnn["us"], cudnn_out_contiguous=cudnn["out_contiguous"])
    if default and best:
        out["best_flash_saves_ms"] = (default["us"] - best["us"]) * layers / 1e3
    if default and cudnn:
        out["cudnn_saves_ms"] = (default["us"] - cudnn["us"]) * layers / 1e3
    return out


def print_table(rows: list[dict]) -> None:
    print(f"\n{'T':>5} {'D':>4}  {'variant':44s} {'us':>8} {'TF/s':>6} {'xSDPAcud':>8} "
          f"{'rel_err':>8}")
    for r in sorted(rows, key=lambda r: (r["tokens"], r["head_dim"],
                                         r.get("us", float("inf")))):
        if "error" in r:
            print(f"{r['tokens']:>5} {r['head_dim']:>4}  {r['name']:44s} ERROR {r['error']}")
            continue
        flag = "" if r["ok"] else "  WRONG"
        ratio = f"{r['vs_sdpa_cudnn']:.3f}" if "vs_sdpa_cudnn" in r else "-"
        print(f"{r['tokens']:>5} {r['head_dim']:>4}  {r['name']:44s} {r['us']:8.1f} "
              f"{r['tflops']:6.0f} {ratio:>8} {r['rel_err']:8.1e}{flag}"
              + ("" if r["timing"] in ("graph", "cpu (interpreted)") else f"  [{r['timing']}]"))


def print_verdicts(verdicts: list[dict]) -> None:
    for v in verdicts:
        if not v:
            continue
        head = f"T={v['tokens']} D={v['head_dim']} ({v['model']}, x{v['layers']} layers): "
        parts = []
        if "default_us" in v:
            parts.append(f"default {v['default_us']:.1f} us")
        if "best_flash_us" in v:
            parts.append(f"best {v['best_flash']} {v['best_flash_us']:.1f} us "
                         f"(saves {v.get('best_flash_saves_ms', 0):.3f} ms a prefill)")
        if "cudnn_us" in v:
            parts.append(f"cuDNN {v['cudnn_us']:.1f} us (saves "
                         f"{v.get('cudnn_saves_ms', 0):.3f} ms a prefill; output "
                         f"{'token-major' if v['cudnn_out_contiguous'] else 'NOT contiguous'})")
        print("VERDICT " + head + "; ".join(parts), flush=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 512, 4096])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--budget-s", type=float, default=float("inf"))
    ap.add_argument("--quick", action="store_true", help=f"the first {QUICK} tiles per head dim")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes on the CPU (interpreted flash; the CUDA variants skip)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    heads = HEADS
    if not cuda:
        heads, args.tokens, args.dims = (4, 2), [37], [16]
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu (smoke)",
                    "torch": torch.__version__, "heads": heads, "rows": [], "verdicts": [],
                    "cudnn_version": torch.backends.cudnn.version() if cuda else None}
    for t in args.tokens:
        for d in args.dims:
            if time.perf_counter() - START > args.budget_s:
                print(f"== T={t} D={d}: skipped (past --budget-s {args.budget_s:.0f})")
                continue
            rows = sweep_shape(t, d, heads=heads, quick=args.quick, cuda=cuda)
            result["rows"] += rows
            result["verdicts"].append(verdict(rows))
            print_verdicts(result["verdicts"][-1:])
            print(f"   ({time.perf_counter() - START:.0f} s)", flush=True)
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "prefill_attention_sweep.json").write_text(
                    json.dumps(result, indent=1, default=str))
    print_table(result["rows"])
    print_verdicts(result["verdicts"])
    return result


if __name__ == "__main__":
    main()
