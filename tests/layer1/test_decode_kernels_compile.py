"""The decode kernels (and the tiled matmuls) compile for a Hopper GPU (sm_90), checked on any
machine: Triton's interpreter runs kernel code as Python, so it accepts code the compiler
rejects (it once hid a `return` inside a constexpr branch that the compiler does not honour).
A subprocess with TRITON_INTERPRET=0 compiles each kernel ahead of time for cuda:90 (ptxas
ships with Triton)."""
from __future__ import annotations

import json

from .sm90 import run_compile_script

SCRIPT = r'''
import os
os.environ["TRITON_INTERPRET"] = "0"
import importlib
from tests.layer1.sm90 import compile_for_sm90 as compile_
# (import_module: the package's `gemv` and `paged_decode` names are the functions)
G, P, R, GR, A, MM, I8 = (importlib.import_module(f"layer1_kernels.{m}") for m in (
    "gemv", "paged_decode", "rope_kv_write", "gemv_rope", "argmax", "matmul", "int8_matmul"))

CASES = [(1, True, 1, 2, 2048, 2048, True, 1), (0, False, 1, 2, 2048, 2048, True, 1),
         (2, False, 1, 8, 2048, 8192, True, 1), (1, True, 4, 2, 512, 2048, False, 1),
         (2, False, 8, 4, 128, 8192, False, 1), (1, True, 1, 4, 512, 4096, True, 3),
         (2, False, 1, 8, 256, 3584, True, 4), (2, False, 4, 8, 128, 14336, True, 3)]
for pro, res, bm, bn, bk, k, pdl, st in CASES:
    kern = compile_(G._gemv_kernel, dict(K=k, PROLOGUE=pro, HAS_RESIDUAL=res, HAS_BIAS=False,
                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=True, STATS_K=min(k, 8192 // bm),
                    STAGES=st, PDL=pdl, PDL_EARLY=pdl and bm == 1), {},
                    {"num_warps": 4, "launch_pdl": pdl}, aligned=True)
    # stages > 1: the weight tiles go through shared memory (cp.async), else straight loads
    assert ("cp.async" in kern.asm["ptx"]) == (st > 1), (bn, bk, st)
rope_ptrs = {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64"}
for res, bm, bp, bk, early, st in [(True, 1, 1, 2048, False, 1), (False, 1, 1, 2048, True, 1),
                                   (True, 4, 2, 256, False, 1), (True, 1, 2, 512, False, 3)]:
    compile_(GR._gemv_rope_kernel, dict(K=2048, N_PAIRS=1536, HALF=32, HEAD_D=64, NQ=32, NKV=8,
             PROLOGUE=1, HAS_RESIDUAL=res, HAS_BIAS=False, BLOCK_M=bm, BLOCK_P=bp, BLOCK_K=bk,
             EVEN_K=True, STATS_K=8192 // bm, STAGES=st, PDL=True, PDL_EARLY=early), rope_ptrs,
             {"num_warps": 8, "launch_pdl": True})
ptrs = {"tables_ptr": "*i64", "seq_lens_ptr": "*i64", "part_o_ptr": "*fp32",
        "part_lse_ptr": "*fp32", "count_ptr": "*i32"}
for ident, fused, heads_first in [(True, True, False), (False, True, True), (False, False, False)]:
    compile_(P._paged_decode_kernel, dict(HEAD_DIM=64, PAGE=385 if ident else 16, BLOCK_G=16,
             BLOCK_N=64, WINDOWED=False, IDENTITY=ident, FUSED_MERGE=fused,
             PDL=True, MERGE_G=4, MERGE_S=16, HEADS_FIRST=heads_first,
             EARLY_INDEX=not ident, HEADS=1, PEEL=not ident,
             TRIGGER_EARLY=ident, PIPELINED_IDS=False), ptrs,
             {"num_warps": 4, "num_stages": 2, "launch_pdl": True})
compile_(R._rope_cache_kernel, dict(HALF=32, BLOCK_D=32, BLOCK_HQ=32, BLOCK_HK=8, PDL=True),
         {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64"},
         {"num_warps": 4, "launch_pdl": True})
compile_(A._argmax_kernel, dict(BLOCK=4096, PIECES=32, PDL=True),
         {"x_ptr": "*fp32", "out_ptr": "*i64", "part_v_ptr": "*fp32", "part_i_ptr": "*i32",
          "count_ptr": "*i32"}, {"num_warps": 4, "launch_pdl": True})
# the tiled matmul and its int8-weight variant (they share jit helpers: _tile_offsets, _store_tile)
compile_(MM._matmul_kernel, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8,
         INPUT_PRECISION="tf32", HAS_SCALE=True), {"scale_a_ptr": "*fp32", "scale_b_ptr": "*fp32"},
         {"num_warps": 8, "num_stages": 3})
compile_(I8._w8a16_kernel.fn, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, PRECISION="tf32"),
         {"w_ptr": "*i8"}, {"num_warps": 4, "num_stages": 4})
print("compiled")
'''


def test_decode_kernels_compile_for_sm90():
    run = run_compile_script(SCRIPT, "compiling the decode kernels")
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


def test_gemv_occupancy_shows_the_rows_starving_the_tile():
    """benchmarks/gemv_occupancy.py (what layer 3's FUSED_DECODE_MAX_TOKENS rests on): compiled
    for sm_90a, the GEMV loads 16-byte vectors at one row and has far fewer weight bytes in
    flight per SM at eight rows than at one."""
    code = ("import json, sys; sys.argv = ['x']; import importlib.util as u; "
            "s = u.spec_from_file_location('g', 'benchmarks/gemv_occupancy.py'); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); "
            "print('JSON', json.dumps(m.main(['--shapes', '1B gate_up', '--rows', '1,8'])))")
    run = run_compile_script(code, "compiling two GEMV configs")
    assert run.returncode == 0, run.stderr[-3000:]
    one, eight = json.loads(run.stdout.split("JSON ", 1)[1])
    assert "ld.global.v4.b32" in one["loads"]
    assert eight["in_flight_KB_per_SM"] * 4 < one["in_flight_KB_per_SM"]
