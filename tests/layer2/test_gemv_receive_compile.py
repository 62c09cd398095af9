"""The GEMVs that receive the all-reduce in their prologue (gemv_receive.py), compiled for an
H100/H200 (sm_90) on the CPU with the ptxas in Triton's wheel, at Llama-3.1-8B's TP=2 gate_up
and qkv shapes with their tuned tiles: the receive is chunk tickets (atomic adds), polls
(volatile loads, the clock), a done count (an acq_rel atomic add), gpu-scope release stores of
the ready flag's copies and a gpu-scope acquire of one (nothing at system scope); no packet is
sent; under PDL the first weight tiles are requested before griddepcontrol.wait and the
tickets come after it; nothing spills to local memory. Nothing runs; no GPU needed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .test_peer_kernels_compile import _ptxas_here

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from layer2_comm import gemv_receive

BF16 = ("x_ptr", "r_ptr", "h_ptr", "nw_ptr", "w_ptr", "y_ptr", "kc_ptr", "vc_ptr")
I32 = ("sum_words", "mine_words", "state_ptr", "sync_ptr")

def build(name, world, pdl, out_dir):
    rope = name == "rope"
    fn = gemv_receive.norm_gemv_rope_receive_kernel if rope else \
        gemv_receive.norm_gemv_receive_kernel
    consts = dict(K=4096, BLOCK_K=1024, EVEN_K=True, STATS_K=4096, STAGES=1, RANK=1,
                  WORLD=world, KIND=2, CHUNK=gemv_receive.chunk_words(128), STATE_BLOCKS=64,
                  PDL=pdl, PDL_EARLY=False)
    if rope:  # 8B TP=2: 16 q heads, 4 kv heads of 128
        consts.update(N_PAIRS=1536, HALF=64, HEAD_D=128, NQ=16, NKV=4, BLOCK_P=2)
    else:
        consts.update(BLOCK_N=4)
    sig, attrs = {}, {}
    for i, a in enumerate(fn.arg_names):
        if a in consts:
            sig[a] = "constexpr"
        elif a in BF16 or a in I32 or a in ("cos_ptr", "sin_ptr", "pos_ptr", "slot_ptr"):
            sig[a] = ("*bf16" if a in BF16 else "*i32" if a in I32 else
                      "*fp32" if a in ("cos_ptr", "sin_ptr") else "*i64")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif a == "lls":
            sig[a] = tuple(["*i64"] * world)
            for j in range(world):
                attrs[(i, j)] = [["tt.divisibility", 16]]
        elif a in ("status_addr", "timeout_ns"):
            sig[a] = "i64"
        elif a == "eps":
            sig[a] = "fp32"
        else:
            sig[a] = "i32"
            if a in ("stride_wn", "slot_words", "table_stride") or a.startswith(("kc_", "vc_")):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    path = os.path.join(out_dir, f"{name}_{world}_{int(pdl)}.cubin")
    open(path, "wb").write(ck.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    text = subprocess.run([tool, "-sass", path], capture_output=True, text=True,
                          check=True).stdout
    line = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]*)", re.M)
    return {"ptx": ck.asm["ptx"], "sass": [m.group(1) for m in line.finditer(text)]}

done = {}
for job in json.loads(sys.argv[1]):
    try:
        done[json.dumps(job)] = build(*job, sys.argv[2])
    except Exception as e:  # noqa: BLE001
        done[json.dumps(job)] = f"{type(e).__name__}: {e}"
print(json.dumps(done))
'''

pytestmark = pytest.mark.skipif(not _ptxas_here(),
                                reason="Triton's wheel has no ptxas/cuobjdump here")

#: (kernel, world, PDL): gate_up's norm GEMV and qkv's with RoPE, 2 and 4 ranks, PDL or not
JOBS = [("norm", 2, True), ("rope", 2, True), ("norm", 4, False), ("rope", 4, True)]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": f"{ROOT}{os.pathsep}"
           + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(JOBS),
                           str(tmp_path_factory.mktemp("gemv_receive"))], capture_output=True,
                          text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for job, result in got.items():
        assert isinstance(result, dict), f"{job}: {result}"  # the compile's error
    return {tuple(json.loads(k)): v for k, v in got.items()}


@pytest.mark.parametrize("job", JOBS, ids=lambda j: f"{j[0]}-w{j[1]}-pdl{int(j[2])}")
def test_ticket_takers_receive_every_program_waits_for_the_flag(compiled, job):
    ptx, sass = compiled[job]["ptx"], compiled[job]["sass"]
    assert "atom.global.gpu.relaxed.add" in ptx  # the tickets
    assert "atom.global.gpu.acq_rel.add" in ptx  # the chunks done
    assert ".exch" not in ptx  # no election
    assert "ld.volatile.global" in ptx and "%globaltimer" in ptx  # the takers' polls
    assert "st.release.gpu.global.u32" in ptx  # the flag's copies, after the last chunk
    assert "ld.acquire.gpu.global.u32" in ptx  # every program's wait for its copy
    assert ".sys." not in ptx.replace("st.relaxed.sys.global.u32", "")  # but the status word
    assert "st.volatile.global.b64" not in ptx  # a receiver sends nothing
    assert not any(op.startswith(("STL", "LDL")) for op in sass), "spills to local memory"


@pytest.mark.parametrize("job", JOBS, ids=lambda j: f"{j[0]}-w{j[1]}-pdl{int(j[2])}")
def test_every_peer_is_polled_at_once(compiled, job):
    """A chunk's first poll: every peer's packets requested before any is checked (the
    volatile loads of the W - 1 peers precede the first reduction's barrier)."""
    ptx, world = compiled[job]["ptx"], job[1]
    start = ptx.index("ld.volatile.global")
    first_check = ptx.index("bar.sync", start)
    assert ptx.count("ld.volatile.global", start, first_check) >= world - 1


@pytest.mark.parametrize("job", [j for j in JOBS if j[2]], ids=lambda j: f"{j[0]}-w{j[1]}")
def test_weights_before_the_pdl_wait_the_tickets_after(compiled, job):
    ptx = compiled[job]["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    assert "ld.global" in ptx[:wait], "the first weight tile is not requested before the wait"
    assert wait < ptx.index("atom.global"), "the tickets must follow the PDL wait"
    assert "griddepcontrol.launch_dependents" in ptx
