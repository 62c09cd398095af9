"""Pipeline parallelism: schedules as lists, gradients equal to one process, bubble, timeline.

Ranks are layer 2's `launch` processes on gloo; one launch per world size runs every case
(schedules x micro-batch counts), each compared on every rank with a single-process run.
"""
from __future__ import annotations

import pytest
import torch

import layer5_parallel as L5
from layer5_parallel import train_adapter as A
from layer5_parallel.pipeline_parallel import schedules as S

# layer 2's launch: ranks forked from one server (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("fork_server_module")

# (schedule, micro-batches, tied embedding) per world size: m = 3..5 on 2 and 3 stages
CASES = {2: [("gpipe", 3, False), ("1f1b", 5, False), ("1f1b", 4, True)],
         3: [("gpipe", 4, False), ("1f1b", 3, False), ("1f1b", 5, True)]}


def _rank_cases() -> list[dict]:
    """Every case on this rank: max |grad - reference grad| over the stage's parameters."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # one core per rank: the ranks share a small machine
    out = []
    for k, (sched, m, tie) in enumerate(CASES[dist.get_world_size()]):
        config = A.tiny_config(layers=4, hidden=48, heads=4, kv_heads=2, vocab=70, ffn=88, tie=tie)
        model = A.build_model(config, seed=10 + k)
        ids, targets = A.random_batch(config, batch=m + 2, seq_len=5, seed=k)  # uneven splits
        ref = A.build_model(config, seed=10 + k)
        ref_loss = A.full_loss(ref, ids, targets)
        ref_loss.backward()
        stage, stages = dist.get_rank(), dist.get_world_size()
        total = sum(p.numel() * 4 for p in model.parameters())
        kept = L5.keep_stage(model, stage, stages)  # this rank holds only its layers
        assert 0 < kept < total
        res = L5.pipeline_step(model, ids, targets, micro_batches=m, schedule_name=sched)
        names = {id(p): n for n, p in model.named_parameters()}
        ref_params = dict(ref.named_parameters())
        errs = [(p.grad - ref_params[names[id(p)]].grad).abs().max().item()
                for p in L5.stage_params(model, stage, stages)]
        others = [p.grad for p in model.parameters()
                  if id(p) not in {id(q) for q in L5.stage_params(model, stage, stages)}]
        out.append(dict(sched=sched, m=m, err=max(errs), n_params=len(errs),
                        foreign_grads=sum(g is not None for g in others),
                        loss_err=None if res.loss is None else abs(res.loss - ref_loss.item()),
                        ops=len(res.events),
                        ref_scale=ref_params["embed.weight"].grad.abs().max().item()))
    return out


@pytest.fixture(scope="module", params=[2, 3])
def world_results(request):
    p = request.param
    return p, L5.engine.executor.comm.launch(_rank_cases, p, backend="gloo", timeout_s=240)


def test_schedules_are_complete_and_ordered():
    for p in (1, 2, 3, 4):
        for m in (1, 3, 5):
            for name in S.SCHEDULES:
                for s in range(p):
                    ops = S.schedule(name, s, p, m)
                    assert sorted(ops) == sorted([S.Op("F", i) for i in range(m)]
                                                 + [S.Op("B", i) for i in range(m)])
                    assert all(ops.index(S.Op("F", i)) < ops.index(S.Op("B", i)) for i in range(m))
    assert [str(o) for o in S.one_f_one_b(0, 3, 4)] == "F0 F1 F2 B0 F3 B1 B2 B3".split()
    assert [str(o) for o in S.one_f_one_b(2, 3, 4)] == "F0 B0 F1 B1 F2 B2 F3 B3".split()
    # 1F1B holds at most p - s micro-batches; GPipe holds all m
    assert S.max_in_flight(S.one_f_one_b(0, 4, 8)) == 4
    assert S.max_in_flight(S.gpipe(0, 4, 8)) == 8


def test_simulated_bubble_matches_formula():
    for name in S.SCHEDULES:
        for p, m in [(2, 3), (3, 4), (4, 8)]:
            lanes = S.simulate(name, p, m, t_f=1.0, t_b=2.0)
            span = max(e for lane in lanes for _, _, e in lane)
            assert span == pytest.approx((m + p - 1) * 3.0)
            for lane in lanes:
                idle = 1 - sum(e - s for _, s, e in lane) / span
                assert idle == pytest.approx(S.bubble_fraction(p, m))


def test_bad_input():
    with pytest.raises(ValueError, match="unknown schedule"):
        S.schedule("zigzag", 0, 2, 3)
    with pytest.raises(ValueError, match="stages"):
        L5.partition(3, 4)
    assert [list(r) for r in L5.partition(5, 3)] == [[0, 1], [2, 3], [4]]


def test_gradients_equal_single_process(world_results):
    p, results = world_results
    for rank, cases in enumerate(results):
        for case in cases:
            assert case["foreign_grads"] == 0, case  # a stage touches only its own layers
            assert case["err"] <= 1e-5 * max(1.0, case["ref_scale"]), (p, rank, case)
            assert case["ops"] == 2 * case["m"]
            if rank == p - 1:
                assert case["loss_err"] < 1e-5, case
    assert sum(len(L5.stage_params(A.build_model(A.tiny_config()), s, p)) for s in range(p)) \
        == len(list(A.build_model(A.tiny_config()).parameters()))


def _mismatched_rank() -> None:
    import torch.distributed as dist

    config = A.tiny_config(layers=2, hidden=16, heads=2, kv_heads=1, vocab=20, ffn=24)
    ids, targets = A.random_batch(config, batch=4, seq_len=3, seed=0)
    m = 4 if dist.get_rank() == 0 else 2  # the stages disagree on the schedule
    # the headers name the disagreement at once; the timeout is only a net for a stage that
    # arrives late (a busy machine), so it is no shorter than a late arrival may be
    L5.pipeline_step(A.build_model(config), ids, targets, micro_batches=m, timeout_s=30)


def test_mismatched_stages_fail_clearly_without_hanging():
    with pytest.raises(RuntimeError) as err:
        L5.engine.executor.comm.launch(_mismatched_rank, 2, backend="gloo", timeout_s=120)
    for rank in (0, 1):  # every stage names the disagreement
        assert f"rank {rank} raised ValueError: pipeline stages disagree" in str(err.value)


def test_timeline_png(tmp_path):
    lanes = [[("F" if op.kind == "F" else "B", op.micro, s, e) for op, s, e in lane]
             for lane in S.simulate("1f1b", 3, 4)]
    paths = L5.plot_rank_timelines(lanes, tmp_path, "sim", "1F1B p=3 m=4 (simulated)")
    assert len(paths) == 4 and all(p.stat().st_size > 1000 for p in paths)
