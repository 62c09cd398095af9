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
