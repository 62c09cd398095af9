"""Decode-batch projections at tensor parallelism's per-rank shapes: cuBLAS (F.linear) against
layer 1's skinny_matmul over a few launch configs.

    python benchmarks/tp_gemm_shapes.py [--rows 8,32] [--budget-s 80] [--out DIR]

Shapes: rank 0's of Llama-3.1-8B at TP=1/2/4 (qkv: N = 6144 / p, K = 4096; o_proj: 4096 x
4096 / p; gate_up: 28672 / p x 4096; down: 4096 x 14336 / p), bf16, M rows (decode
sequences). Each call is timed under CUDA-graph replay over enough weight copies (> 256 MB)
that none is in L2, as the engine's decode graphs read them; every skinny config's output is
checked against F.linear first (a wrong one is reported and never "best"). Prints a line per
shape (flushed): us per call and weight TB/s for cuBLAS and each config, the best, and per TP
size the layer's four projections summed. Writes DIR/tp_gemm_shapes.json when --out is given.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from layer1_kernels.skinny_matmul import skinny_matmul  # noqa: E402

T0 = time.monotonic()
ROTATE_BYTES = 256e6
# (BLOCK_N, BLOCK_K, warps, stages[, split K])
CONFIGS = [(16, 256, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4), (16, 512, 4, 3), (64, 256, 8, 3),
           (64, 128, 4, 4, 4), (128, 128, 8, 3, 4), (64, 256, 4, 3, 2)]


def log(msg: str) -> None:
    print(f"[tp-gemm +{time.monotonic() - T0:6.1f} s] {msg}", flush=True)


def shapes(tp: int) -> dict[str, tuple[int, int]]:
    return {"qkv": (6144 // tp, 4096), "o_proj": (4096, 4096 // tp),
            "gate_up": (28672 // tp, 4096), "down": (4096, 14336 // tp)}


def replay_us(fn, copies: int, reps: int = 5) -> float:
    """us per call: a CUDA graph of one call per weight copy, replayed; median of reps."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / copies)
    del graph
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--tps", default="1,2,4")
    ap.add_argument("--budget-s", type=float, default=80.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    log(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    rows_out = []
    for tp in (int(t) for t in args.tps.split(",")):
        for M in (int(m) for m in args.rows.split(",")):
            layer = {"cublas": 0.0, "best": 0.0}
            for name, (N, K) in shapes(tp).items():
                if time.monotonic() - T0 > args.budget_s:
                    log("budget spent: stopping")
                    break
                nbytes = N * K * 2
                copies = max(2, int(ROTATE_BYTES // nbytes) + 1)
                ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
                      for _ in range(copies)]
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                ys = [None] * copies
                ref = F.linear(x, ws[0]).float()

                def cublas(i):
                    ys[i] = F.linear(x, ws[i])
                row = {"tp": tp, "M": M, "proj": name, "N": N, "K": K,
                       "cublas_us": replay_us(cublas, copies)}
                best = (row["cublas_us"], "cublas")
                parts = []
                for cfg in CONFIGS:
                    try:
                        y = skinny_matmul(x, ws[0], config=cfg).float()
                        err = (y - ref).abs().max().item()
                        if err > 0.02 * ref.abs().max().item() + 1e-2:
                            parts.append(f"{cfg}: WRONG (err {err:.3g})")
                            continue

                        def ours(i, cfg=cfg):
                            ys[i] = skinny_matmul(x, ws[i], config=cfg)
                        us = replay_us(ours, copies)
                    except Exception as exc:  # noqa: BLE001 - a config that fails is reported
                        parts.append(f"{cfg}: {type(exc).__name__}")
                        continue
                    row[str(cfg)] = us
                    parts.append(f"{cfg} {us:.2f}")
                    best = min(best, (us, str(cfg)))
                row["best_us"], row["best"] = best
                layer["cublas"] += row["cublas_us"]
                layer["best"] += best[0]
                rows_out.append(row)
                log(f"TP={tp} M={M} {name} {N}x{K} ({nbytes / 1e6:.1f} MB): cuBLAS "
                    f"{row['cublas_us']:.2f} us ({nbytes / row['cublas_us'] / 1e6:.2f} TB/s); "
                    f"best {best[1]} {best[0]:.2f} us ({nbytes / best[0] / 1e6:.2f} TB/s) | "
                    + "; ".join(parts))
                del ws, ys
                torch.cuda.empty_cache()
            log(f"TP={tp} M={M}: a layer's four projections: cuBLAS {layer['cublas']:.1f} us, "
                f"best of each {layer['best']:.1f} us")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tp_gemm_shapes.json").write_text(json.dumps(rows_out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
