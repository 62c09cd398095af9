"""Async scheduling on a CUDA GPU (skipped without one): the default there; outputs equal the
synchronous engine's, eager and with CUDA-graph decode, with EOS ends, preemption, seeded
sampling; the pinned staging buffers copy right."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import layer3_model as l3
from layer4_algorithms import LLM, SamplingParams

from .l4_helpers import assert_no_leak, greedy, random_prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cuda_graph", [False, True])
@pytest.mark.parametrize("block_size,budget,blocks", [(16, 2048, 64), (4, 7, 64), (4, 64, 11)])
def test_async_equals_sync_on_cuda(cuda_model, cuda_graph, block_size, budget, blocks):
    prompts = random_prompts((5, 17, 3, 30, 9, 1, 12))
    params = [greedy(m) for m in (8, 3, 12, 5, 10, 6, 1)]
    params.append(SamplingParams(temperature=0.0, max_tokens=30))  # EOS ends some
    prompts.append(random_prompts([4], seed=1)[0])
    params.append(SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True))
    prompts.append(prompts[0])
    outs = []
    for mode in (None, False):
        llm = LLM(cuda_model, block_size=block_size, num_blocks=blocks,
                  max_num_batched_tokens=budget, cuda_graph=cuda_graph, max_num_seqs=8,
                  async_scheduling=mode)
        assert llm.config.async_scheduling is (mode is None)  # None: on for CUDA
        outs.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                     for o in llm.generate(prompts, params)])
        assert_no_leak(llm)
    assert outs[0] == outs[1]


def test_staging_copies_right_and_reuses_arenas():
    st = l3.HostStaging("cuda", arenas=2, capacity=8)
    got = []
    for step in range(6):
        st.next_step()
        parts = [np.arange(step, step + n, dtype=np.int64) for n in (3, 7, 20)]  # grows
        got.append([st.to_device(p) for p in parts])
    torch.cuda.synchronize()
    for step, tensors in enumerate(got):
        for n, t in zip((3, 7, 20), tensors, strict=True):
            assert t.device.type == "cuda"
            assert torch.equal(t.cpu(), torch.arange(step, step + n))


def test_graph_argmax_serves_greedy_steps_and_logprobs_stay_right(cuda_model, monkeypatch):
    """With CUDA-graph decode, an all-greedy step takes the argmax the graph computed (no
    sampling launch after the replay); the tokens equal the eager engine's, and requests
    asking for logprobs or sampling (the logits read after the graph) get the eager
    engine's tokens and logprobs too, alone and beside greedy rows."""
    import layer4_algorithms.model_runner as MR  # noqa: PLC0415

    calls = []
    inner = MR.greedy_tokens
    monkeypatch.setattr(MR, "greedy_tokens", lambda x: calls.append(x.shape[0]) or inner(x))
    prompts = random_prompts((5, 17, 3, 30, 9))
    runs = {
        "greedy": [greedy(m) for m in (12, 9, 16, 7, 10)],
        "logprobs": [greedy(12), greedy(9, logprobs=3), greedy(16), greedy(7, logprobs=1),
                     greedy(10)],
        "sampled": [greedy(12), SamplingParams(temperature=0.7, seed=5, max_tokens=9,
                                               ignore_eos=True), greedy(16), greedy(7),
                    greedy(10)],
    }
    for name, params in runs.items():
        outs = []
        for graphs in (False, True):
            llm = LLM(cuda_model, block_size=4, num_blocks=96, cuda_graph=graphs, max_num_seqs=8)
            calls.clear()
            got = llm.generate(prompts, params)
            outs.append(([o.outputs[0].token_ids for o in got],
                         [o.outputs[0].logprobs for o in got]))
            if graphs and name == "greedy":  # only the prefill's first tokens launched one
                assert len(calls) <= 2, calls
            assert_no_leak(llm)
        (ids0, lp0), (ids1, lp1) = outs
        assert ids0 == ids1, name
        for a, b in zip(lp0, lp1, strict=True):
            assert (a is None) == (b is None)
            for x, y in zip(a or [], b or [], strict=True):
                assert x.token_id == y.token_id and [t for t, _ in x.top] == [t for t, _ in y.top]
                assert abs(x.logprob - y.logprob) < 1e-3
