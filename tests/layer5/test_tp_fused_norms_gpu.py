"""On GPUs: tensor parallelism with the fused norms on (each row-parallel all-reduce done by
layer 2's one-shot kernel together with the residual add and RMSNorm after it) gives TP=1's
greedy tokens and logits within bf16 tolerance, CUDA graphs on every rank: decode steps of
several sequences (the general path, where the fused norms run) and prefills."""
from __future__ import annotations

import pytest
import torch

from layer5_parallel.tensor_parallel import shard as S

from .test_tp_graph_gpu import _bf16_tp_equals_tp1


@pytest.mark.multigpu
def test_fused_norms_with_our_all_reduce_equal_tp1_tokens(monkeypatch):
    monkeypatch.setenv(S.FUSED_NORMS_ENV, "1")  # read by rank 0 and the spawned workers
    _bf16_tp_equals_tp1("triton", 4 if torch.cuda.device_count() >= 4 else 2, "ours")
