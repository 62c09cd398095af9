"""A pipeline's greedy steps take token ids from the last stage instead of logits
(pipeline_parallel/runner.py), and with one rank a stage the step's block table goes to the
stages with its message instead of a broadcast: the outputs are exactly those of the logits
and broadcast path.

gloo stages on the CPU (PP=2), the random qwen2-shaped model of test_pp_engine, fp32. The
workload mixes greedy requests with sampled ones (seeded: each draws from its own generator),
a greedy request with logprobs (host sampling) and one with n=2 (forked children), so some
steps (and some lanes, with steps in flight) are all greedy and take ids, and others take
logits. Each layout runs twice in one process: with the ids path, and with it switched off
(every step's logits back to rank 0 and its ids | slots | tables broadcast, as before);
tokens, logprobs and finish reasons must be equal, not just near.
"""
from __future__ import annotations

import pytest
import torch

import layer5_parallel as l5
from layer5_parallel.pipeline_parallel import PPModel
from layer5_parallel.pipeline_parallel import runner as pp_runner

from .test_pp_engine import random_config

l3 = l5.engine.executor
# no prefix cache: the second run must compute what the first did, batch for batch
ENGINE = dict(num_blocks=48, block_size=4, max_num_seqs=8, cuda_graph=True,
              enable_prefix_caching=False)


def workload(vocab: int = 211) -> tuple[list[list[int]], list[l5.SamplingParams]]:
    g = torch.Generator().manual_seed(3)
    prompts, params = [], []
    for i in range(11):
        prompts.append(torch.randint(0, vocab, (int(torch.randint(2, 12, (1,), generator=g)),),
                                     generator=g).tolist())
        sampled, longest = i in (2, 7), int(torch.randint(6, 16, (1,), generator=g))
        params.append(l5.SamplingParams(  # (the others finish first: later steps all greedy)
            temperature=0.9 if sampled else 0.0, seed=100 + i if sampled else None,
            ignore_eos=True, max_tokens=4 if sampled or i == 9 else longest,
            n=2 if i == 4 else 1, logprobs=2 if i == 9 else None))
    return prompts, params


def outputs(outs) -> list:
    return [[(c.token_ids, c.finish_reason,
              None if c.logprobs is None else [(t.token_id, t.logprob, t.top) for t in c.logprobs])
             for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def model() -> l3.Model:
    return l3.Model(l3.random_model(random_config(), seed=11, std=0.3))


@pytest.mark.parametrize("k,m", [(2, 1), (1, 2), (1, 1)])
def test_token_ids_back_equal_logits_back(model, monkeypatch, k, m):
    """k steps in flight (2: two lanes), m micro-batches a step (1: decode steps from host
    arrays, runner.StageDecode; drained, k = 1, they are collected at once)."""
    both_ways(model, monkeypatch, k, m)


@pytest.mark.multigpu
@pytest.mark.parametrize("k,m", [(2, 1), (1, 2)])
def test_token_ids_back_equal_logits_back_on_gpus(monkeypatch, k, m):
    """The same on two GPUs (NCCL, stage graphs captured; with steps in flight each step
    lands on a stream of its own): the course model in fp32."""
    path = l3.course_model_dir("target")
    vocab = l3.ModelConfig.from_pretrained(path).vocab_size
    both_ways(path, monkeypatch, k, m, vocab=vocab, device="cuda", dtype="float32")


def both_ways(model, monkeypatch, k: int, m: int, vocab: int = 211, **kw) -> None:
    prompts, params = workload(vocab)
    seen = []
    decide = pp_runner.greedy_ids

    def spy(out) -> bool:
        seen.append(decide(out))
        return seen[-1]

    monkeypatch.setattr(pp_runner, "greedy_ids", spy)
    with l5.LLM(model, pipeline_parallel_size=2, pp_steps_in_flight=k, pp_micro_batches=m,
                **ENGINE, **kw) as llm:
        with_ids = outputs(llm.generate(prompts, params))
        graphs = llm.runner.net.graphs
        assert graphs.captured == (llm.runner.net.device.type == "cuda")
        graphs = graphs.replays
        # the block tables went with the messages: rank 0 broadcast nothing
        assert llm.tp_group.comm.calls == 0
        # as before: every step's logits back, its ids | slots | tables broadcast, rank 0's
        # decode steps through an AttentionContext (no StageDecode)
        monkeypatch.setattr(pp_runner, "greedy_ids", lambda out: False)
        monkeypatch.setattr(PPModel, "_table_for_ring", lambda self, ctx, cache: None)
        fast, llm.runner.graph = llm.runner.graph, None
        with_logits = outputs(llm.generate(prompts, params))
        assert llm.tp_group.comm.calls > 0
        # decode steps from host arrays: one micro-batch a step (steps in flight)
        assert fast.can_run(2, 1) == (m == 1)
    for i, (a, b) in enumerate(zip(with_ids, with_logits, strict=True)):
        assert [c[:2] for c in a] == [c[:2] for c in b], f"request {i}: {a} != {b}"
        for (_, _, lp_a), (_, _, lp_b) in zip(a, b, strict=True):  # the same numbers
            assert (lp_a is None) == (lp_b is None), f"request {i}"
            for x, y in zip(lp_a or [], lp_b or [], strict=True):
                assert x[0] == y[0] and [t for t, _ in x[2]] == [t for t, _ in y[2]]
                assert x[1] == pytest.approx(y[1], abs=1e-5), f"request {i}: {x} != {y}"
    assert True in seen and False in seen, "both kinds of step should have run"
    assert graphs > 0  # decode micro-batches ran through the stage graphs (copy=False: ids)
    assert with_ids[9][0][2] is not None and len(with_ids[4]) == 2


def test_only_steps_of_greedy_rows_with_nothing_more_take_ids():
    def step(**kw):
        seq = l5.engine.Sequence(0, "r", [1, 2, 3], l5.SamplingParams(**kw))
        return l5.engine.SchedulerOutput(scheduled=[l5.engine.ScheduledSeq(seq, 3, 0)])

    assert pp_runner.greedy_ids(step(temperature=0.0))
    assert not pp_runner.greedy_ids(step(temperature=0.7))
    assert not pp_runner.greedy_ids(step(temperature=0.0, logprobs=1))
    assert not pp_runner.greedy_ids(step(temperature=0.0, presence_penalty=0.5))
    assert not pp_runner.greedy_ids(l5.engine.SchedulerOutput(scheduled=[]))
