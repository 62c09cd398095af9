"""The planner's formulas against the things they predict: parameter counts of real modules,
the bytes of an actual TP shard and paged cache, layer 2's cost model; its recommendations on
cases whose answer is clear; its command's errors."""
from __future__ import annotations

import math

import pytest
import torch

import layer5_parallel as l5
from layer5_parallel import planner
from layer5_parallel.bench import commands
from layer5_parallel.runtime import weight_bytes
from layer5_parallel.tensor_parallel.shard import shard_model

l3 = l5.engine.executor


def awkward(tied: bool) -> l3.ModelConfig:
    """FFN 90 and vocab 211 do not split evenly over 4 ranks; 8 query heads, 2 kv heads."""
    return l3.ModelConfig(model_type="llama", vocab_size=211, hidden_size=48, intermediate_size=90,
                          num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=6, tie_word_embeddings=tied)


@pytest.mark.parametrize("name", list(planner.SHAPES))
def test_param_count_matches_the_module(name):
    c = planner.load_config(name)
    with torch.device("meta"):
        net = l3.LlamaModel(c)
    assert planner.weight_params(c, 1) == net.num_parameters()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_per_rank_weights_match_the_fullest_shard(tp, tied):
    c = awkward(tied)
    net = l3.random_model(c, seed=tp)
    shards = [weight_bytes(shard_model(net, r, tp, comm=None)) for r in range(tp)]
    assert planner.weight_params(c, tp) * 4 == max(shards)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kv_bytes_match_the_paged_cache(tp):
    c = awkward(False)
    per_block = l5.engine.bytes_per_block(l5.tp_config(c, tp, 0), 16, torch.float32)
    seqs, context = 3, 37
    assert planner.kv_bytes(c, tp, 1, seqs, context, nbytes=4) == per_block // 16 * seqs * context
    # pipeline stages split the layers (3 layers over 2 stages: the fuller one has 2)
    assert planner.kv_bytes(c, tp, 2, seqs, context, 4) == per_block // 16 * seqs * context * 2 // 3


def test_tp_comm_is_two_all_reduces_per_layer_plus_embedding_and_logits():
    c, link = awkward(False), l3.comm.AlphaBeta.from_link(5.0, 100.0)
    seqs, tp = 7, 4
    msg = seqs * c.hidden_size * 2
    ar = min(l3.comm.predict("ring_all_reduce", msg, tp, link),
             l3.comm.predict("tree_all_reduce", msg, tp, link))
    gather = l3.comm.predict("ring_all_gather", seqs * c.vocab_size * 2, tp, link)
    expected = (2 * c.num_hidden_layers + 1) * ar + gather
    assert planner.tp_comm_seconds(c, tp, 1, seqs, link) == pytest.approx(expected)
    assert planner.tp_comm_seconds(c, 1, 1, seqs, link) == 0.0
    # a library's fixed cost per call: every all-reduce and the all-gather pay it
    extra = planner.tp_comm_seconds(c, tp, 1, seqs, link, collective_s=1e-5) - expected
    assert extra == pytest.approx((2 * c.num_hidden_layers + 2) * 1e-5)


def test_nccl_costs_more_per_collective_than_peer_memory():
    c = planner.load_config("llama-3-8b")
    nccl, ours = planner.hardware_for("h100"), planner.hardware_for("h100", tp_backend="ours")
    a, b = (planner.cost(c, hw, 2, 1, 1, batch=1, context=256) for hw in (nccl, ours))
    assert a.compute_s == b.compute_s and a.tp_comm_s > b.tp_comm_s
    with pytest.raises(ValueError, match="tp_backend"):
        planner.hardware_for("h100", tp_backend="mpi")


def test_decode_step_is_the_roofline_plus_comm():
    c, hw = planner.load_config("llama-3-8b"), planner.hardware_for("h100")
    lay = planner.cost(c, hw, 2, 2, 1, batch=4, context=1000)
    W = planner.weight_params(c, 2, 2) * 2
    K = planner.kv_bytes(c, 2, 2, 4, 1000)
    assert lay.compute_s == pytest.approx((W + K) / hw.bandwidth)  # batch 4: memory-bound
    p2p = hw.link.message(4 * c.hidden_size * 2)
    kernels = c.num_hidden_layers // 2 * planner.GENERAL_KERNELS_PER_LAYER * planner.KERNEL_S
    assert lay.kernels_s == pytest.approx(kernels)
    assert lay.step_s == pytest.approx(2 * (lay.compute_s + lay.tp_comm_s + kernels) + p2p)
    assert lay.tokens_per_s == pytest.approx(4 / lay.step_s)


def test_recommendations():
    h100 = planner.hardware_for("h100")
    work = dict(batch=32, context=2048)
    best, why = planner.recommend(planner.load_config("llama-3.2-1b"), h100, 1, **work)
    assert (best.tp, best.pp, best.dp) == (1, 1, 1)
    c70 = planner.load_config("llama-3-70b")  # 131 GiB of bf16 weights: not one 80 GiB GPU
    best, why = planner.recommend(c70, h100, 8, **work)
    assert best.tp * best.pp >= 2 and best.memory <= 0.9 * h100.memory
    assert "GiB" in why and f"tp={best.tp}" in why
    with pytest.raises(ValueError, match="no layout"):
        planner.recommend(c70, planner.hardware_for("l4"), 1, **work)
    assert all(lay.tp in l5.valid_tp_sizes(c70) for lay in planner.layouts(c70, h100, 8, **work))


def test_bad_input_is_one_line_and_exit_2(capsys):
    assert commands.plan(["--model", "no-such-model", "--gpus", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "llama-3-8b" in err[0]
    assert commands.plan(["--model", "llama-3-8b", "--gpus", "2", "--device", "tpu9"]) == 2
    assert commands.plan(["--model", "llama-3-8b", "--gpus", "0"]) == 2
    assert commands.plan(["--model", "llama-3-8b", "--gpus", "2"]) == 0
    assert "recommended: tp=" in capsys.readouterr().out
    assert math.isfinite(planner.cost(awkward(True), planner.hardware_for("a100"), 1, 1, 1,
                                      batch=1, context=1).step_s)


def test_run_with_a_tp_the_heads_do_not_allow_is_one_line_and_exit_2(capsys):
    run_command = l3.comm.kernels.hardware.run_command
    assert run_command(commands.run, ["--tp", "4", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "valid sizes: 1, 2, 6" in err[0]
    assert run_command(commands.run, ["--tp", "1", "--device", "cpu"]) == 2


def test_kernels_per_layer_follow_the_decode_path():
    """One sequence a rank: layer 3's fused decode kernels; more: the general path's; a dp
    replica's share of the batch decides, and the steps differ by exactly those kernels."""
    c, hw = planner.load_config("llama-3-8b"), planner.hardware_for("h200", tp_backend="ours")
    assert planner.kernels_per_layer(1) < planner.kernels_per_layer(2) == \
        planner.kernels_per_layer(32)
    one = planner.cost(c, hw, 2, 1, 1, batch=1, context=192)
    two_replicas = planner.cost(c, hw, 2, 1, 2, batch=2, context=192)  # one sequence each
    assert one.kernels_s == two_replicas.kernels_s == pytest.approx(
        c.num_hidden_layers * planner.FUSED_KERNELS_PER_LAYER * planner.KERNEL_S)
    many = planner.cost(c, hw, 2, 1, 1, batch=32, context=192)
    assert many.kernels_s == pytest.approx(
        c.num_hidden_layers * planner.GENERAL_KERNELS_PER_LAYER * planner.KERNEL_S)
