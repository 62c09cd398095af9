"""Megatron-SP's sharded RMSNorm + MLP block equals the unsharded block, forward and backward,
on gloo ranks. Fresh random inputs (seed in failure messages), sequence lengths and hidden
sizes no rank count divides."""
from __future__ import annotations

import random

import pytest
import torch

import layer5_parallel as l5
from layer5_parallel.tensor_parallel.sequence_parallel import SequenceParallelMLP, mlp_block

from .engine_checks import assert_ranks_match

# layer 2's launch: ranks forked from one server (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("fork_server_module")

seeds = random.SystemRandom()
CASES = [(13, 8, 10), (5, 6, 7), (32, 16, 24)]  # (S, D, F)


def _weights(case: tuple, seed: int) -> dict[str, torch.Tensor]:
    S, D, F = case
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(S, D, generator=g), norm_w=1 + 0.1 * torch.randn(D, generator=g),
                w_gate=torch.randn(F, D, generator=g) / D**0.5,
                w_up=torch.randn(F, D, generator=g) / D**0.5,
                w_down=torch.randn(D, F, generator=g) / F**0.5,
                grad_out=torch.randn(S, D, generator=g))


def rank_checks(seed: int) -> list[tuple]:
    comm = l5.engine.executor.comm
    me, p = comm.rank(), comm.world_size()
    results = []
    for case in CASES:
        w = _weights(case, seed)
        S, F = case[0], case[2]
        a, b = comm.segment_bounds(S, p)[me]
        f0, f1 = comm.segment_bounds(F, p)[me]
        # the reference: the whole block in this process
        full = {k: v.clone().requires_grad_() for k, v in w.items() if k != "grad_out"}
        want = mlp_block(**full)
        want.backward(w["grad_out"])
        # the sequence-parallel block on this rank's rows
        block = SequenceParallelMLP(w["norm_w"], w["w_gate"], w["w_up"], w["w_down"])
        x = w["x"][a:b].clone().requires_grad_()
        got = block(x, S)
        got.backward(w["grad_out"][a:b])
        block.all_reduce_grads()
        pairs = {"out": (got, want[a:b]), "dx": (x.grad, full["x"].grad[a:b]),
                 "dnorm": (block.norm_w.grad, full["norm_w"].grad),
                 "dgate": (block.w_gate.grad, full["w_gate"].grad[f0:f1]),
                 "dup": (block.w_up.grad, full["w_up"].grad[f0:f1]),
                 "ddown": (block.w_down.grad, full["w_down"].grad[:, f0:f1])}
        results.append((case, {k: (g.detach(), r.detach()) for k, (g, r) in pairs.items()}))
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_sequence_parallel_block_equals_unsharded(world):
    assert_ranks_match(rank_checks, world, seeds.randrange(2**31))


def test_bad_shapes_are_named():
    w = _weights((4, 6, 5), 0)
    block = SequenceParallelMLP(w["norm_w"], w["w_gate"], w["w_up"], w["w_down"])  # one rank
    with pytest.raises(ValueError, match=r"rows \[0, 4\) of 4"):
        block(torch.randn(3, 6), 4)
