"""What the sm_90 compile tests share: layer 2's kernels compiled for an H100/H200 on the CPU
with the ptxas and cuobjdump that ship in Triton's wheel, every case in one process (each would
otherwise import torch and Triton again). A test's script imports triton, GPUTarget and
ASTSource and defines `build(*job, out_dir)`; SCRIPT_TAIL gives it `source` and `sass_ops` and
runs every job, reporting a compile's failure for its own case. Nothing runs on a GPU."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT_TAIL = r'''
def source(fn, consts, ptrs, world, divisible=()):
    """fn's ASTSource: consts (name -> value) constexpr; ptrs name -> pointer type, or (type,)
    for a tuple of one pointer a rank; every pointer 16-byte aligned; eps fp32; status_addr and
    timeout_ns i64; the rest i32, multiples of 16 where named in divisible."""
    sig, attrs = {}, {}
    for i, a in enumerate(fn.arg_names):
        if a in consts:
            sig[a] = "constexpr"
        elif isinstance(ptrs.get(a), tuple):
            sig[a] = tuple(ptrs[a] * world)
            for j in range(world):
                attrs[(i, j)] = [["tt.divisibility", 16]]
        elif a in ptrs:
            sig[a] = ptrs[a]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif a == "eps":
            sig[a] = "fp32"
        elif a in ("status_addr", "timeout_ns"):
            sig[a] = "i64"
        else:
            sig[a] = "i32"
            if a in divisible:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=fn, signature=sig, attrs=attrs,
                     constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})


def sass_ops(ck, path):
    """The SASS opcodes of compiled kernel ck (its cubin written to path), in order."""
    open(path, "wb").write(ck.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    text = subprocess.run([tool, "-sass", path], capture_output=True, text=True,
                          check=True).stdout
    line = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]*)", re.M)
    return [m.group(1) for m in line.finditer(text)]


done = {}
for job in json.loads(sys.argv[1]):
    try:
        done[json.dumps(job)] = build(*job, sys.argv[2])
    except Exception as e:  # noqa: BLE001
        done[json.dumps(job)] = f"{type(e).__name__}: {e}"
print(json.dumps(done))
'''


def ptxas_here() -> bool:
    """Whether Triton's wheel has ptxas and cuobjdump. Found without importing Triton: an
    import here, before layer 1 has chosen the interpreter, would leave the kernels that this
    process defines later (the interpreted tests') compiled instead of interpreted."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return False
    bin_dir = Path(spec.submodule_search_locations[0]) / "backends" / "nvidia" / "bin"
    return (bin_dir / "ptxas").exists() and (bin_dir / "cuobjdump").exists()


def compile_all(script: str, jobs: list, out_dir: Path) -> dict:
    """script + SCRIPT_TAIL run over jobs in one process -> {json.dumps(job): build's result
    or the compile's error text}."""
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": f"{ROOT}{os.pathsep}" + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", script + SCRIPT_TAIL, json.dumps(jobs),
                           str(out_dir)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
