"""Prefill's MLP up-projection two ways, per shape: cuBLAS's gate_up GEMM then layer 1's
silu_and_mul (what the model runs with LLM_STACK_GEMM_SWIGLU=0) vs layer 1's gemm_swiglu (one
kernel, the SiLU in the GEMM's epilogue), and the cuBLAS GEMM alone (the fused kernel's floor
if its epilogue were free). Also every tile config in CONFIGS, to check pick_config's table.

    python benchmarks/gemm_swiglu_bench.py --out DIR     # -> DIR/gemm_swiglu.json

Shapes: Llama-3.2-1B (K=H=2048, F=8192) and Llama-3.1-8B (K=4096, F=14336) at 2048, 512 and
777 rows. Times: triton.testing.do_bench medians (us), bf16, random operands; TFLOP/s count the
GEMM's 2*M*2F*K FLOPs. Each configuration is checked against the unfused path first.
"""
from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import layer1_kernels as kernels

gs = importlib.import_module("layer1_kernels.gemm_swiglu")  # the module (its name is the op's)

SHAPES = [  # (name, M, K, F)
    ("1B", 2048, 2048, 8192), ("1B", 512, 2048, 8192), ("1B", 777, 2048, 8192),
    ("8B", 2048, 4096, 14336), ("8B", 512, 4096, 14336),
]
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages): the table's two tiles and neighbours
CONFIGS = [(128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 128, 64, 16, 8, 3),
           (64, 128, 64, 8, 4, 4), (128, 64, 64, 8, 4, 4), (128, 128, 128, 8, 8, 2),
           (64, 256, 64, 8, 8, 3)]


def _median_us(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_shape(name: str, M: int, K: int, Fdim: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(M + K)
    x = torch.randn(M, K, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(2 * Fdim, K, device="cuda", generator=gen) * K ** -0.5).bfloat16()
    flops = 2 * M * 2 * Fdim * K

    def unfused():
        return kernels.silu_and_mul(F.linear(x, w))

    ref = unfused()
    t_gemm = _median_us(lambda: F.linear(x, w))
    t_unfused = _median_us(unfused)
    fused_out = kernels.gemm_swiglu(x, w)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    row = {"shape": name, "M": M, "K": K, "F": Fdim, "tma": kernels.gemm_swiglu_uses_tma(x, w),
           "table_config": gs.pick_config(M, Fdim, K, sms),
           "cublas_gemm_us": t_gemm, "unfused_us": t_unfused,
           "fused_us": _median_us(lambda: kernels.gemm_swiglu(x, w)),
           "fused_rel_err_vs_unfused": _rel(fused_out, ref)}
    row["speedup_vs_unfused"] = t_unfused / row["fused_us"]
    row["fused_vs_cublas_gemm_alone"] = t_gemm / row["fused_us"]
    for k in ("cublas_gemm", "unfused", "fused"):
        row[f"{k}_TFLOPs"] = flops / row[f"{k}_us"] / 1e6
    sweep = {}
    for bm, bn, bk, group, warps, stages in CONFIGS:
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_warps=warps,
                   num_stages=stages)
        key = f"{bm}x{bn}x{bk}_g{group}_w{warps}_s{stages}"
        try:
            err = _rel(kernels.gemm_swiglu(x, w, config=cfg), ref)
            sweep[key] = {"us": _median_us(lambda c=cfg: kernels.gemm_swiglu(x, w, config=c)),
                          "rel_err": err}
        except Exception as e:  # noqa: BLE001  (out of shared memory, ...: recorded, not fatal)
            sweep[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    row["configs"] = sweep
    ok = {k: v["us"] for k, v in sweep.items() if "us" in v and v["rel_err"] < 1e-2}
    if ok:
        row["best_config"] = min(ok, key=ok.get)
        row["best_config_us"] = ok[row["best_config"]]
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                      if k != "configs"}), flush=True)
    print("   ", {k: (round(v["us"], 1) if "us" in v else v["error"][:60])
                  for k, v in sweep.items()}, flush=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    rows = [bench_shape(*s) for s in SHAPES]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemm_swiglu.json").write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
