"""Pipeline steps in flight (pp_steps_in_flight=k): greedy outputs equal one process's.

gloo stages on the CPU (PP=2, PP=3, and TP=2 x PP=2: 4 ranks), a random qwen2-shaped model
with 5 layers (PP=2: 3+2, PP=3: 2+2+1), fp32, drawn afresh each run (the seed is in every
failure message). The workload is awkward on purpose: an odd number of requests of odd
lengths, each with its own max_tokens (they finish at different steps), a shared prefix
(prefix cache), one request with n=2 (forked children, copy-on-write) and one with logprobs
(host sampling), half of the requests added while the others run, one aborted mid-run, and a
KV pool small enough to preempt. Each request's greedy tokens must equal the single-process
engine's, or first differ where that engine's top two logits nearly tie (a step of another
batch size sums in another order).
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os

import pytest
import torch

import layer5_parallel as l5
from layer5_parallel.pipeline_parallel.in_flight import LaneScheduler

from .engine_checks import assert_same_or_near_tie_at
from .test_pp_engine import random_config

l3 = l5.engine.executor
ENGINE = dict(num_blocks=13, block_size=4, max_num_seqs=7)
SEED = int.from_bytes(os.urandom(4), "little")


def workload(seed: int) -> tuple[list[list[int]], list[l5.SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 211, (9,), generator=g).tolist()
    prompts, params = [], []
    for i in range(13):
        own = torch.randint(0, 211, (int(torch.randint(1, 14, (1,), generator=g)),),
                            generator=g).tolist()
        prompts.append(prefix + own if i % 3 else own)
        params.append(l5.SamplingParams(
            temperature=0.0, ignore_eos=True, max_tokens=int(torch.randint(2, 20, (1,),
                                                                           generator=g)),
            n=2 if i == 4 else 1, logprobs=1 if i == 6 else None))
    return prompts, params


def run_online(llm, prompts, params, abort: int) -> tuple[dict[int, list[list[int]]], int]:
    """Half the requests first, the rest after two steps, request `abort` aborted after four;
    step until done. Returns {prompt index: its completions' tokens} and the most steps
    seen in flight at once."""
    ids: dict[str, int] = {}
    done: dict[int, list[list[int]]] = {}
    most, steps = 0, 0
    half = len(prompts) // 2
    for i in range(half):
        ids[llm.add_request(prompts[i], params[i])] = i
    while llm.has_unfinished() or len(ids) < len(prompts):
        if steps == 2:
            for i in range(half, len(prompts)):
                ids[llm.add_request(prompts[i], params[i])] = i
        if steps == 4:
            llm.abort(next(r for r, i in ids.items() if i == abort))
        for o in llm.step(unfinished=False):
            done[ids[o.request_id]] = [c.token_ids for c in o.outputs]
        most = max(most, len(getattr(llm, "_flights", ())))
        steps += 1
        assert steps < 500, "the engine made no progress"
    llm.drain()
    return done, most


@pytest.fixture(scope="module")
def model() -> l3.Model:
    return l3.Model(l3.random_model(random_config(), seed=SEED, std=0.3))


@pytest.fixture(scope="module")
def ref(model):
    prompts, params = workload(SEED)
    llm = l5.LLM(model, **ENGINE)
    outs = llm.generate(prompts, params)
    return {"llm": llm, "prompts": prompts, "params": params,
            "tokens": [[c.token_ids for c in o.outputs] for o in outs]}


@pytest.mark.parametrize("pp,k,tp,m,overlap", [(2, 2, 1, None, False), (3, 3, 1, None, False),
                                                (2, 3, 1, 3, False), (2, 2, 2, None, False),
                                                (2, 2, 1, None, True), (3, 3, 1, 2, True),
                                                (2, 2, 2, None, True)])
def test_steps_in_flight_equal_one_process(model, ref, pp, k, tp, m, overlap):
    """(tp = 2: each stage two tensor-parallel ranks, 4 ranks in all; m = 3: each lane's step
    cut into 3 micro-batches, prefill chunks too; overlap: async scheduling, a GPU's default,
    so a lane's next step is dispatched before its previous step's tokens reach the host,
    its inputs gathered from them on the device.)"""
    prompts, params = ref["prompts"], ref["params"]
    with l5.LLM(model, pipeline_parallel_size=pp, tensor_parallel_size=tp, pp_steps_in_flight=k,
                pp_micro_batches=m, async_scheduling=overlap, **ENGINE) as llm:
        got, most = run_online(llm, prompts, params, abort=5)
        stats = llm.stats
        again = llm.generate(prompts, params)  # offline, prefix cache warm: the same tokens
        busy = llm.runner.net.stage_busy()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("l5-rank")]
    where = f"seed {SEED}, PP={pp} x TP={tp}, {k} steps in flight, m={m}, overlap={overlap}"
    # (k only when the pool lets every lane hold sequences at once: 2 shows steps overlap)
    assert 2 <= most <= k, f"{where}: at most {most} steps were in flight"
    assert stats.preemptions > 0, f"{where}: the pool never ran short"
    assert sorted(got) == [i for i in range(len(prompts)) if i != 5]
    assert len(got[4]) == 2
    for i, completions in got.items():
        for want, tokens in zip(ref["tokens"][i], completions, strict=True):
            assert_same_or_near_tie_at(ref["llm"], prompts[i], want, tokens,
                                       f"{where}, prompt {i}")
    for i, o in enumerate(again):  # offline, the prefix cache warm: every request, none aborted
        for want, c in zip(ref["tokens"][i], o.outputs, strict=True):
            assert_same_or_near_tie_at(ref["llm"], prompts[i], want, c.token_ids,
                                       f"{where}, again, prompt {i}")
    assert all(row["busy_s"] > 0 for row in busy)


def test_lane_scheduler_keeps_lanes_apart():
    """No ranks: lanes schedule disjoint sequences, each within its seats, and a lane short of
    blocks preempts only its own sequences (another lane's step may be in flight)."""
    config = l5.EngineConfig(num_blocks=12, block_size=4, max_num_seqs=5, max_model_len=64)
    sched = LaneScheduler(l5.engine.BlockManager.from_config(config), config, lanes=2)
    assert sched.seats == 2
    params = l5.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    seqs = [l5.engine.Sequence(i, f"r{i}", list(range(1, 8 + i)), params) for i in range(5)]
    for q in seqs:
        sched.add(q)
    for step in range(16):
        lane = step % 2
        before = dict(sched.lane_of)
        out = sched.schedule_lane(lane)
        assert all(before.get(s.seq.seq_id, lane) == lane for s in out.scheduled)
        assert all(before[q.seq_id] == lane for q in out.preempted)  # only its own lane's
        assert sum(x == lane for x in sched.lane_of.values()) <= sched.seats
        assert len(sched.running) == len(sched.lane_of)
        sched.postprocess(out, {s.seq.seq_id: [5] for s in out.scheduled if s.samples})
        # each lane's own list holds its running sequences; `running` is all of them
        assert sched.running == [q for lane_seqs in sched.lane_running for q in lane_seqs]
        assert all(sched.lane_of[q.seq_id] == g
                   for g, lane_seqs in enumerate(sched.lane_running) for q in lane_seqs)
    assert sched.num_preemptions > 0
    with pytest.raises(ValueError, match="seats"):
        sched.add(l5.engine.Sequence(9, "r9", [1, 2], l5.SamplingParams(n=3)))


@pytest.mark.parametrize("kw,words", [
    (dict(pp_steps_in_flight=2), "needs pipeline_parallel_size > 1"),
    (dict(pipeline_parallel_size=2, pp_steps_in_flight=0), "positive int"),
    (dict(pipeline_parallel_size=2, pp_steps_in_flight=2, scheduling="static"), "static"),
    (dict(pipeline_parallel_size=2, pp_steps_in_flight=3, max_num_seqs=2), "max_num_seqs"),
    (dict(pipeline_parallel_size=2, pp_steps_in_flight=2,
          speculative=dict(method="ngram", k=3)), "speculative"),
])
def test_bad_settings_are_named(kw, words):
    with pytest.raises(ValueError, match=words):
        l5.EngineConfig(**kw)


def test_a_few_requests_spread_over_the_lanes():
    """Four requests, three lanes of 5 seats: a lane admits at most its fair share,
    ceil(4 / 3) = 2, not all four, so another lane has a step to run beside it."""
    config = l5.EngineConfig(num_blocks=64, block_size=4, max_num_seqs=16, max_model_len=64)
    sched = LaneScheduler(l5.engine.BlockManager.from_config(config), config, lanes=3)
    params = l5.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(4):
        sched.add(l5.engine.Sequence(i, f"r{i}", [1, 2, 3], params))
    sizes = [len(sched.schedule_lane(lane).scheduled) for lane in range(3)]
    assert sizes == [2, 2, 0]


def test_a_mixed_step_stays_one_deferred_pass_where_no_stage_pads():
    """Layer 4's runner cuts a mixed step into passes (and steps in flight drain first) when
    rank 0's net pads attention: a pipeline's answer is the shard's kernels judged against the
    whole model's config: the triton kernels pad nothing, unless a sliding window sits in any
    stage's layers (here the last layer, on stage 1); the torch kernels pad."""
    from layer5_parallel.pipeline_parallel import PPModel
    from layer5_parallel.pipeline_parallel.stage import StageNet

    config = dataclasses.replace(random_config(4), head_dim=16)
    windowed = dataclasses.replace(config, layer_windows=(None, None, None, 8))
    for cfg, backend, pads in ((config, "triton", False), (windowed, "triton", True),
                               (config, "torch", True)):
        stage = StageNet(l3.random_model(cfg, backend=backend, seed=0), 0, 2)
        assert l3.pads_prefill_attention(stage) is (backend == "torch")  # stage 0's own layers
        assert l3.pads_prefill_attention(PPModel(stage, None, 1)) is pads, (cfg, backend)
