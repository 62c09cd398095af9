"""The GEMV that sends its outputs as LL packets and the receive kernel, compiled for an
H100/H200 (sm_90) on the CPU with the ptxas in Triton's wheel (as test_peer_kernels_compile.py):
the sender's epilogue has the 8-byte volatile stores (one per peer) and nothing that waits
(no polling load, no clock, no fence); the receive kernel polls with volatile loads and stores
no packet; under PDL the sender waits for its predecessor (griddepcontrol.wait) and the
receive waits first, then lets its dependents launch. Nothing runs; no GPU needed."""
from __future__ import annotations

import json

import pytest

from .sm90 import compile_all, ptxas_here

SCRIPT = r'''
import json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from layer2_comm import gemv_send, peer_kernels

def build(name, world, prologue, pdl, out_dir):
    fn = gemv_send.gemv_send_kernel if name == "send" else peer_kernels.ll_receive_kernel
    consts = dict(RANK=1, WORLD=world, PDL=pdl)
    if name == "send":
        consts.update(K=2048, PROLOGUE=prologue, BLOCK_N=2, BLOCK_K=2048, EVEN_K=True, STAGES=1,
                      PDL_EARLY=False)
    else:
        consts.update(BLOCK=16 * 32 * 2, KIND=2)
    ptrs = dict.fromkeys(("x_ptr", "w_ptr", "y_ptr", "out_ptr"),
                         "*bf16" if name == "send" else "*i32")
    ptrs.update(state_ptr="*i32", lls=("*i64",))
    src = source(fn, consts, ptrs, world, ("stride_wn", "slot_words", "nwords"))
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 8 if name == "send" else 16})
    path = os.path.join(out_dir, f"{name}_{world}_{prologue}_{int(pdl)}.cubin")
    return {"ptx": ck.asm["ptx"], "sass": sass_ops(ck, path)}
'''

pytestmark = pytest.mark.skipif(not ptxas_here(),
                                reason="Triton's wheel has no ptxas/cuobjdump here")

#: (kernel, world, prologue, PDL): both prologues, 2 and 4 ranks, with and without PDL
JOBS = [("send", 2, 0, True), ("send", 4, 2, False), ("send", 2, 2, True),
        ("receive", 2, 0, True), ("receive", 4, 0, False)]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    got = compile_all(SCRIPT, JOBS, tmp_path_factory.mktemp("gemv_send"))
    for job, result in got.items():
        assert isinstance(result, dict), f"{job}: {result}"  # the compile's error
    return {tuple(json.loads(k)): v for k, v in got.items()}


@pytest.mark.parametrize("world,prologue,pdl", [(2, 0, True), (4, 2, False), (2, 2, True)])
def test_sender_stores_packets_and_never_waits(compiled, world, prologue, pdl):
    ptx, sass = compiled[("send", world, prologue, pdl)]["ptx"], \
        compiled[("send", world, prologue, pdl)]["sass"]
    # one 8-byte volatile store per peer in the epilogue's (inlined) PTX, .sys-strong in SASS
    assert ptx.count("st.volatile.global.b64") == world - 1
    assert any(op.startswith("STG.E.64.STRONG.SYS") for op in sass)
    # nothing that waits: no polling load, no clock, no fence, no acquire
    for waits in ("ld.volatile", "%globaltimer", "ld.acquire", "membar", "fence."):
        assert waits not in ptx, waits
    assert ("griddepcontrol.wait" in ptx) == pdl
    assert ("griddepcontrol.launch_dependents" in ptx) == pdl


@pytest.mark.parametrize("world,pdl", [(2, True), (4, False)])
def test_receive_polls_and_sends_nothing(compiled, world, pdl):
    ptx = compiled[("receive", world, 0, pdl)]["ptx"]
    assert "st.volatile.global.b64" not in ptx
    assert "ld.volatile.global" in ptx and "%globaltimer" in ptx
    if pdl:  # wait for the sender, then let the next GEMV launch
        assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")
    else:
        assert "griddepcontrol" not in ptx
