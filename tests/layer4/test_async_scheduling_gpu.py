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
    import layer4_algorithms.step_sampling as MR  # noqa: PLC0415

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


def test_token_copies_back_reuse_pooled_pinned_buffers_and_events():
    """LaunchedStep.on_device copies a step's tokens into a pooled pinned buffer behind a
    pooled event: two steps in flight at once each read their own tokens, a read step hands
    its buffer and event back (the step forgets them), and the next step reuses them."""
    from types import SimpleNamespace  # noqa: PLC0415

    from layer4_algorithms.launched_step import LaunchedStep  # noqa: PLC0415

    def seqs(n, base):
        return [SimpleNamespace(seq_id=base + i, num_tokens=5, num_prompt_tokens=3,
                                num_pending=0, pending_index=-1) for i in range(n)]

    a_who, b_who = seqs(3, 0), seqs(5, 100)
    a = LaunchedStep.on_device(None, a_who, torch.arange(3, device="cuda") + 10, None)
    b = LaunchedStep.on_device(None, b_who, torch.arange(5, device="cuda") + 20, None)
    assert a.tokens.is_pinned() and a.event is not None and not a.first_only
    used = {a.tokens.data_ptr(), b.tokens.data_ptr()}
    assert len(used) == 2 and [q.pending_index for q in b_who] == list(range(5))
    assert b.read() == {100 + i: [20 + i] for i in range(5)}
    assert b.tokens is None and b.event is None  # handed back
    assert a.read() == {i: [10 + i] for i in range(3)}
    c = LaunchedStep.on_device(None, seqs(4, 200), torch.arange(4, device="cuda") + 30, None)
    assert c.tokens.data_ptr() in used  # a pooled buffer again
    assert c.read() == {200 + i: [30 + i] for i in range(4)}
    assert all(q.num_pending == 0 for q in a_who + b_who)
