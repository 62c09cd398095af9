"""Compiling layer 1's Triton kernels ahead of time for a Hopper GPU (cuda:90) on any machine:
Triton's interpreter runs kernel code as Python and accepts code the compiler rejects, so the
tests also build each kernel with the real compiler (ptxas ships with Triton; no GPU needed).

`compile_for_sm90` runs inside a subprocess with TRITON_INTERPRET=0 (a script that imports it
from the repo root); `run_compile_script` starts that subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def compile_for_sm90(fn, consts: dict, ptrs: dict, opts: dict, *,
                     scalars: tuple[str, ...] = ("eps", "qk_scale"), aligned: bool = False,
                     divisible: tuple[str, ...] = ()):
    """triton.compile of jit function `fn` for cuda:90: the arguments named in consts are
    constexprs of those values, those in ptrs of the given types, other `*_ptr` arguments
    bf16 pointers, `scalars` fp32, the rest i32. aligned: pointers and `stride*` arguments
    divisible by 16, as the JIT sees them for aligned tensors (its wide loads and cp.async
    copies need that); `divisible`: integer arguments marked so too (the JIT marks any int
    argument that is a multiple of 16). Returns the compiled kernel (its .asm)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig, cx, attrs = {}, {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in divisible or (aligned and n not in consts
                              and (n.endswith("_ptr") or n.startswith("stride"))):
            attrs[(i,)] = [["tt.divisibility", 16]]
        if n in consts:
            sig[n] = "constexpr"
            cx[(i,)] = consts[n]
        elif n in ptrs:
            sig[n] = ptrs[n]
        elif n.endswith("_ptr"):
            sig[n] = "*bf16"
        elif n in scalars:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def run_compile_script(code: str, what: str) -> subprocess.CompletedProcess:
    """Run `code` with the real Triton compiler (TRITON_INTERPRET off) from the repo root;
    skip when Triton is missing, fail past 600 s."""
    try:
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                             text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "0"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} took over 600 s")
    if "No module named" in run.stderr and "triton" in run.stderr:
        pytest.skip("Triton is not installed")
    return run
