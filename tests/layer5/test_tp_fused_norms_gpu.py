"""On GPUs: tensor parallelism with layer 2's all-reduce and its decode options on — the fused
norms (each row-parallel all-reduce done by the one-shot kernel together with the residual add
and RMSNorm after it), PDL (the one-shot kernels launched as programmatic dependents, like the
decode GEMVs around them) and LL (small one-shots as data+flag packets) — gives TP=1's greedy
tokens and logits within bf16 tolerance, CUDA graphs on every rank: prefills, decode steps of
one sequence (the fused GEMV path, where PDL and LL matter) and of four (the general path,
where the fused norms run)."""
from __future__ import annotations

import pytest
import torch

import layer5_parallel as l5
from layer5_parallel.tensor_parallel import shard as S

from .test_tp_graph_gpu import bf16_tp_equals_tp1


@pytest.mark.multigpu
@pytest.mark.parametrize("switches", [("norms",), ("norms", "pdl", "ll")])
def test_fused_norms_with_our_all_reduce_equal_tp1_tokens(monkeypatch, switches):
    peer = l5.engine.comm.PeerAllReduce
    # read by the workers rank 0 spawns; rank 0's class attributes were read at its import
    monkeypatch.setenv(S.FUSED_NORMS_ENV, "1")
    monkeypatch.setenv(peer.PDL_ENV, "1" if "pdl" in switches else "0")
    monkeypatch.setenv(peer.LL_ENV, "1" if "ll" in switches else "0")
    monkeypatch.setattr(peer, "pdl", "pdl" in switches)
    monkeypatch.setattr(peer, "low_latency", "ll" in switches)
    fused, original = [], peer.fuses_norm

    def counted(self, x):  # rank 0's calls (its eager prefills and the graph captures)
        fused.append(original(self, x))
        return fused[-1]

    monkeypatch.setattr(peer, "fuses_norm", counted)
    lls, launch_ll = [], peer._launch_ll
    monkeypatch.setattr(peer, "_launch_ll", lambda self, x, out: (lls.append(1),
                                                                  launch_ll(self, x, out)))
    bf16_tp_equals_tp1("triton", 4 if torch.cuda.device_count() >= 4 else 2, "ours",
                       one_sequence_too=True)
    assert any(fused), "the fused kernel never ran on rank 0"
    assert bool(lls) == ("ll" in switches), "the LL kernel ran (or not) against the switch"
