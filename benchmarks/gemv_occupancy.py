"""Layer 1's decode GEMV as gemv._launch configures it, compiled for sm_90a on any machine (no GPU:
Triton's compiler and the ptxas it ships): registers, load widths and weight bytes in flight
per SM, per projection and row count. What the fused decode path's row limit
(layer 3's backends.FUSED_DECODE_MAX_TOKENS) rests on until a GPU measures it.

    python benchmarks/gemv_occupancy.py [--rows 1,2,4,8]

Per (projection, rows): the launch config (BLOCK_N, BLOCK_K, warps; BLOCK_K shrinks as 1/rows
to keep the rows x BLOCK_N x BLOCK_K product tile in registers), the weight tile one loop step
loads, ptxas's register count, the resident programs per SM that count allows (65,536
registers, 64 warps), capped by the programs the launch has per SM (132 SMs), and their
product: the weight bytes one SM has in flight when every program waits on one tile (the
kernel's loads feed no tl.dot, so Triton does not pipeline them across steps). Pointers and
strides get the 16-byte divisibility the JIT sees for aligned tensors, so the load widths
are the real ones. (qkv's rows are the plain norm-prologue GEMV: with RoPE fused, the default,
qkv runs gemv_rope's kernel, tiled by rotary pairs.)
"""
from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "0")  # compile, do not interpret

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

GEMV = importlib.import_module("layer1_kernels.gemv")  # (the package's `gemv` is the function)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
SMS = 132
# (N, K, prologue): 1 = RMSNorm with the residual (qkv, gate_up), 2 = SiLU-and-multiply (down)
SHAPES = {"1B qkv": (3072, 2048, 1), "1B o_proj": (2048, 2048, 0), "1B gate_up": (16384, 2048, 1),
          "1B down": (2048, 8192, 2), "8B qkv": (6144, 4096, 1), "8B gate_up": (28672, 4096, 1),
          "8B down": (4096, 14336, 2)}


def launch_config(n: int, k: int, rows: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, BLOCK_M, stages) as gemv._launch picks them."""
    bn, bk, warps, stages = GEMV._unpack(GEMV.config_for(n, k, rows))
    bm = GEMV.next_pow2(rows)
    if bm > 1:
        bk = min(bk, max(16, 4096 // (bm * bn)))
    return bn, bk, warps, bm, stages


def compile_ptx(consts: dict, warps: int):
    """The compiled kernel: .asm["ptx"], .metadata.shared (bytes of shared memory)."""
    fn = GEMV._gemv_kernel
    sig, cx, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name.endswith("_ptr") or name.startswith("stride") or name == "N":
            attrs[(i,)] = [["tt.divisibility", 16]]
        if name in consts:
            sig[name], cx[(i,)] = "constexpr", consts[name]
        else:
            sig[name] = "*bf16" if name.endswith("_ptr") else "fp32" if name == "eps" else "i32"
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "launch_pdl": True})
    return k


def registers(ptx: str) -> int:
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    return int(re.search(r"Used (\d+) registers", out).group(1))


def row(name: str, rows: int) -> dict:
    n, k, prologue = SHAPES[name]
    bn, bk, warps, bm, stages = launch_config(n, k, rows)
    kern = compile_ptx(dict(K=k, PROLOGUE=prologue, HAS_RESIDUAL=prologue == 1, HAS_BIAS=False,
                            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
                            STATS_K=max(16, min(GEMV.next_pow2(k), 8192 // bm)), STAGES=stages,
                            PDL=True, PDL_EARLY=False), warps)
    ptx = kern.asm["ptx"]
    regs = registers(ptx)
    resident = min(65536 // (max(regs, 1) * 32 * warps), 64 // warps)
    if kern.metadata.shared:  # stages > 1 keep their tiles in shared memory (228 KB an SM)
        resident = min(resident, 232448 // kern.metadata.shared)
    per_sm = min(resident, -(-n // bn) / SMS)
    tile = bn * bk * 2 * stages  # (stages > 1: the pipelined tiles, cp.async into shared)
    loads = collections.Counter(re.findall(r"ld\.global[a-z0-9.:]*|cp\.async\.[a-z0-9.]*", ptx))
    return {"projection": name, "rows": rows, "BLOCK_N": bn, "BLOCK_K": bk, "warps": warps,
            "tile_KB": tile / 1024, "registers": regs, "programs_per_SM": per_sm,
            "in_flight_KB_per_SM": per_sm * tile / 1024, "loads": dict(loads)}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args(argv)
    out = []
    print(f"{'projection':11} rows  BLOCK_N x BLOCK_K warps  tile  regs  progs/SM  in flight/SM"
          "  loads")
    for name in args.shapes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            r = row(name, rows)
            out.append(r)
            print(f"{name:11} {rows:4}  {r['BLOCK_N']:5} x {r['BLOCK_K']:<5} {r['warps']:5} "
                  f"{r['tile_KB']:4.1f}K {r['registers']:5} {r['programs_per_SM']:8.1f}  "
                  f"{r['in_flight_KB_per_SM']:7.1f} KB   {r['loads']}", flush=True)
    return out


if __name__ == "__main__":
    main()
