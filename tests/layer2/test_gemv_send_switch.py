"""LLM_STACK_TP_GEMV_SEND: on unless "0", a ValueError naming anything but 0/1 (read at
import, as layer 2's PDL / LL switches); and where gemv_all_reduce takes the fused path
(sends_from_gemv) and where it falls back to the GEMV and the all-reduce. CPU only."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layer2_comm import PeerAllReduce

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import importlib, os, sys
from layer2_comm import peer_all_reduce as m
out = []
for value in (None, "0", "1", "yes", ""):
    if value is None:
        os.environ.pop(m.GEMV_SEND_ENV, None)
    else:
        os.environ[m.GEMV_SEND_ENV] = value
    try:
        out.append(str(importlib.reload(m).PeerAllReduce.gemv_send))
    except ValueError as e:
        out.append("ValueError" if m.GEMV_SEND_ENV in str(e) else repr(e))
print(",".join(out))
'''


def test_switch_is_on_by_default_and_strict():
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}" + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True,False,True,ValueError,ValueError"
    assert PeerAllReduce.GEMV_SEND_ENV == "LLM_STACK_TP_GEMV_SEND"


def _fake(on=True, slot_words=PeerAllReduce.LL_SLOT_BYTES // 4):
    """The attributes sends_from_gemv reads, on a CPU 'device' (no GPU, no group)."""
    ar = object.__new__(PeerAllReduce)
    ar.gemv_send, ar._ll_slot_words, ar.device = on, slot_words, torch.device("cpu")
    return ar


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sends_from_gemv_where_the_packets_apply(dtype):
    ar, w = _fake(), torch.zeros(4095, 64, dtype=dtype)  # odd N: the last word padded
    x, gu = torch.zeros(1, 64, dtype=dtype), torch.zeros(1, 128, dtype=dtype)
    assert ar.sends_from_gemv(x, w) and ar.sends_from_gemv(gu, w, silu=True)
    assert not ar.sends_from_gemv(gu, w) and not ar.sends_from_gemv(x, w, silu=True)  # K
    assert not _fake(on=False).sends_from_gemv(x, w)  # the switch
    assert not _fake(slot_words=0).sends_from_gemv(x, w)  # no LL region (low_latency off)
    assert not ar.sends_from_gemv(torch.zeros(2, 64, dtype=dtype), w)  # batch 1 only
    assert not ar.sends_from_gemv(x.float(), w.float())  # packets of two 16-bit halves
    assert not ar.sends_from_gemv(x, w.t().contiguous().t())  # rows not contiguous
    big = torch.zeros(PeerAllReduce.LL_MAX_BYTES // 2 + 2, 64, dtype=dtype)
    assert ar.sends_from_gemv(x, big[:-2]) and not ar.sends_from_gemv(x, big)  # LL_MAX_BYTES
