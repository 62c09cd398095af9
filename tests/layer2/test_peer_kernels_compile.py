"""Our peer-memory kernels compiled for an H100/H200 (sm_90) on the CPU, with the ptxas that
ships in Triton's wheel: the inline PTX of the barrier assembles at 2, 3, 4 and 8 ranks, and
the SASS has the shape the kernels' docstrings claim. Nothing runs; no GPU needed. Every
case is compiled in one process, once (module fixture `compiled`), and each test reads its own.

- one `MEMBAR.SYS` per barrier (one lane per peer; the serial barrier has W-1 in a row),
- the peers' 16-byte loads issued before the first add (one NVLink round trip per pass). The
  kernel writes every load first; ptxas still schedules some after the first adds at 3 and 8
  ranks (2 round trips there), all of them first at 2 and 4: the counts below are what it does.
"""
from __future__ import annotations

import json

import pytest

from .sm90 import compile_all, ptxas_here

SCRIPT = r'''
import json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from layer2_comm import peer_kernels as K

def build(world, name, serial, pdl, out_dir):
    fn = getattr(K, f"{name}_kernel")
    ll = name == "one_shot_ll"
    values = {"RANK": 1, "WORLD": world, "BLOCK": 16 * 32 * (2 if ll else 8), "SERIAL": serial,
              "PULL": True, "BLOCK_H": 4096, "PDL": pdl, "KIND": 2}
    ptrs = dict.fromkeys(("x_ptr", "out_ptr", "res_ptr", "w_ptr", "y_ptr", "h_ptr"),
                         "*i32" if ll else "*bf16")
    ptrs.update(state_ptr="*i32", lls=("*i64",), bufs=("*bf16",), pads=("*i32",))
    src = source(fn, {k: v for k, v in values.items() if k in fn.arg_names}, ptrs, world,
                 ("numel", "half_elems", "H", "nwords", "slot_words"))
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 16})
    return sass_ops(ck, os.path.join(out_dir, f"{name}_{world}_{int(serial)}{int(pdl)}.cubin"))
'''


pytestmark = pytest.mark.skipif(not ptxas_here(),
                                reason="Triton's wheel has no ptxas/cuobjdump here")


#: Every (world, kernel, serial barrier, PDL) the tests below read, compiled once for all.
JOBS = ([(w, "one_shot", False, False) for w in (2, 3, 4, 8)] + [(4, "one_shot", True, False)]
        + [(4, n, False, False) for n in ("two_shot", "all_gather", "reduce_scatter")]
        + [(w, "one_shot_norm", False, False) for w in (2, 4)]
        + [(4, n, False, True) for n in ("one_shot", "one_shot_norm")]
        + [(w, "one_shot_ll", False, False) for w in (2, 4)])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    return compile_all(SCRIPT, JOBS, tmp_path_factory.mktemp("sass"))


@pytest.fixture
def sass(compiled):
    def ops(world: int, name: str, serial: bool, pdl: bool = False) -> list[str]:
        got = compiled[json.dumps([world, name, serial, pdl])]
        assert isinstance(got, list), got  # the compile's error
        return got
    return ops


@pytest.mark.parametrize("world,loads_first", [(2, 1), (3, 1), (4, 3), (8, 4)])
def test_one_shot_barrier_and_loads(world, loads_first, sass):
    ops = sass(world, "one_shot", False)
    assert ops.count("MEMBAR.ALL.SYS") == 1  # one barrier, one fence for all peers
    # after the barrier: peers' loads (.cg: STRONG.GPU) before the first add
    first_add = next(i for i, op in enumerate(ops) if op.startswith(("FADD", "HADD2")))
    assert sum(op.startswith("LDG.E.128.STRONG.GPU") for op in ops[:first_add]) >= loads_first


def test_serial_barrier_fences_once_per_peer(sass):
    assert sass(4, "one_shot", True).count("MEMBAR.ALL.SYS") == 3


@pytest.mark.parametrize("name", ["two_shot", "all_gather", "reduce_scatter"])
def test_other_kernels_assemble_at_four_ranks(name, sass):
    ops = sass(4, name, False)
    assert ops.count("MEMBAR.ALL.SYS") == (2 if name == "two_shot" else 1)


@pytest.mark.parametrize("world,loads_first", [(2, 1), (4, 3)])
def test_one_shot_norm_barrier_and_loads(world, loads_first, sass):
    """The all-reduce with the norm in its epilogue: the same one barrier, and the peers' rows
    loaded before the first add."""
    ops = sass(world, "one_shot_norm", False)
    assert ops.count("MEMBAR.ALL.SYS") == 1
    first_add = next(i for i, op in enumerate(ops) if op.startswith(("FADD", "HADD2")))
    assert sum(op.startswith("LDG.E.128.STRONG.GPU") for op in ops[:first_add]) >= loads_first


@pytest.mark.parametrize("name", ["one_shot", "one_shot_norm"])
def test_one_shot_kernels_assemble_with_pdl(name, sass):
    """Launched as programmatic dependents: the grid-dependency wait and trigger come first,
    the barrier is unchanged."""
    ops = sass(4, name, False, pdl=True)
    assert ops.count("MEMBAR.ALL.SYS") == 1
    # griddepcontrol.wait and .launch_dependents, before the first load of x
    first_load = next(i for i, op in enumerate(ops) if op.startswith("LDG.E.128"))
    assert "ACQBULK" in ops[:first_load] and "PREEXIT" in ops[:first_load]
    assert "ACQBULK" not in sass(4, name, False)


@pytest.mark.parametrize("world", [2, 4])
def test_low_latency_one_shot_assembles(world, sass):
    """The LL kernel: no fence and no flag barrier; each packet an 8-byte volatile (.sys)
    store into each peer's region, polled back with volatile loads."""
    ops = sass(world, "one_shot_ll", False)
    assert not any(op.startswith("MEMBAR") for op in ops)
    stores = sum(op.startswith("STG.E.64.STRONG.SYS") for op in ops)
    assert stores == 2 * (world - 1)  # two packets a thread to each peer
    assert any(op.startswith("LDG.E.128.STRONG.SYS") for op in ops)
