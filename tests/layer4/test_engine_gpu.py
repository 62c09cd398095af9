"""The engine on a CUDA GPU (skipped without one): greedy outputs equal layer 3's on the same
device, eager and with CUDA-graph decode (Triton paged attention), with chunked prefill, tiny
blocks, preemption and prefix hits; the KV budget comes from free GPU memory."""
from __future__ import annotations

import pytest
import torch

import layer3_model as l3
from layer4_algorithms import LLM, SamplingParams

from .l4_helpers import TINY, assert_no_leak, greedy, random_prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cuda_graph", [False, True])
@pytest.mark.parametrize("block_size,budget,blocks", [(16, 2048, 64), (4, 7, 64), (4, 64, 11)])
def test_greedy_outputs_equal_layer3_on_cuda(cuda_model, cuda_graph, block_size, budget, blocks):
    prompts = random_prompts((5, 17, 3, 30, 9, 1))
    params = [greedy(m) for m in (8, 3, 12, 5, 10, 6)]
    want = [o.token_ids for o in cuda_model.generate_outputs(prompts, params)]
    llm = LLM(cuda_model, block_size=block_size, num_blocks=blocks, max_num_batched_tokens=budget,
              cuda_graph=cuda_graph, max_num_seqs=8)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert_no_leak(llm)


@pytest.mark.parametrize("block_size,budget,blocks", [(16, 2048, 64), (4, 7, 64), (4, 64, 11)])
def test_prefill_graphs_where_they_work_keep_the_eager_outputs_on_cuda(
        cuda_model, cuda_triton_model, block_size, budget, blocks):
    """prefill_cuda_graph=None ("where it works": on for the triton backend's flash path, off
    for the torch backend) beside CUDA-graph decodes: the greedy tokens of the same engine
    without prefill graphs, through chunked prefill, tiny blocks, preemption and prefix hits
    (the prompts twice), every block returned."""
    kw = dict(block_size=block_size, num_blocks=blocks, max_num_batched_tokens=budget,
              cuda_graph=True, max_num_seqs=8)
    assert LLM(cuda_model, prefill_cuda_graph=None, **kw).runner.prefill_graph is None
    prompts = random_prompts((5, 17, 3, 30, 9, 1))
    params = [greedy(m) for m in (8, 3, 12, 5, 10, 6)]
    eager = LLM(cuda_triton_model, prefill_cuda_graph=False, **kw)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    auto = LLM(cuda_triton_model, prefill_cuda_graph=None, **kw)
    assert auto.runner.prefill_graph is not None and auto.config.prefill_cuda_graph is True
    replays = []
    inner = auto.runner.prefill_graph.run
    auto.runner.prefill_graph.run = lambda *a, **k: replays.append(1) or inner(*a, **k)
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in auto.generate(prompts, params)] == want
        assert_no_leak(auto)
    # a lone prompt is a step the graphs take whatever the budget (six prompts in one step are
    # more sequences than a prefill graph holds: those steps ran eagerly above)
    assert [o.outputs[0].token_ids for o in auto.generate(prompts[3:4], params[3:4])] == want[3:4]
    assert_no_leak(auto)
    assert replays


def test_prefix_hits_and_parallel_sampling_on_cuda(cuda_model):
    shared = random_prompts([12], seed=5)[0]
    prompts = [shared + t for t in random_prompts([3, 6, 1], seed=6)]
    want = [o.token_ids for o in cuda_model.generate_outputs(prompts, greedy(7))]
    llm = LLM(cuda_model, block_size=4, num_blocks=64, cuda_graph=True, max_num_seqs=8)
    llm.generate([shared + [3]], greedy(7))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(7))] == want
    assert llm.stats.prefix_hit_tokens == 36
    out = llm.generate([prompts[0]],
                       l3.SamplingParams(temperature=1.0, seed=4, max_tokens=5, ignore_eos=True))[0]
    many = llm.generate([prompts[0]], SamplingParams(temperature=1.0, seed=4, max_tokens=5,
                                                     ignore_eos=True, n=3))[0]
    assert many.outputs[0].token_ids == out.outputs[0].token_ids and len(many.outputs) == 3
    assert_no_leak(llm)


def test_budget_from_free_gpu_memory(cuda_model):
    free_before, _ = torch.cuda.mem_get_info()
    llm = LLM(cuda_model, block_size=16, gpu_memory_utilization=0.05)
    one_block = llm.cache.nbytes / (llm.block_manager.num_blocks + 1)
    assert 0 < llm.cache.nbytes <= 0.05 * free_before + one_block
    assert llm.cache.k.device.type == "cuda"


@pytest.mark.gpu
def test_cudnn_prefill_attention_through_the_engine_and_its_prefill_graphs():
    """prefill_attention="cudnn" on a bf16 triton model: LLM sets it on the network, a lone
    prompt's step replays from the prefill graphs with cuDNN captured inside, and each
    prompt's first token is the flash engine's within bf16 (the flash engine's token among
    the cuDNN engine's top 5, its logprob within 0.1); a batch of prompts keeps the flash
    kernels and the flash engine's tokens."""
    net = l3.random_model(l3.ModelConfig.from_dict(TINY), seed=0, std=0.3, device="cuda",
                          dtype=torch.bfloat16, backend="triton")
    model = l3.Model(net, None)
    # the batch in one step; no prefix hits (every prompt runs fresh, its layers' k, v its own)
    kw = dict(block_size=16, num_blocks=64, max_num_batched_tokens=256, cuda_graph=True,
              max_num_seqs=4, prefill_cuda_graph=True, enable_prefix_caching=False)
    prompts = random_prompts((5, 17, 30, 100))
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, ignore_eos=True)
    flash = LLM(model, **kw)
    want = [flash.generate([p], params)[0].outputs[0] for p in prompts]
    batch = [o.outputs[0].token_ids for o in flash.generate(prompts, greedy(4))]
    cudnn = LLM(model, prefill_attention="cudnn", **kw)
    assert net.prefill_attention == "cudnn" and cudnn.config.prefill_attention == "cudnn"
    replays = []
    inner = cudnn.runner.prefill_graph.run
    cudnn.runner.prefill_graph.run = lambda *a, **k: replays.append(1) or inner(*a, **k)
    for w, p in zip(want, prompts, strict=True):
        got = cudnn.generate([p], params)[0].outputs[0]
        top = dict(got.logprobs[0].top)
        assert w.token_ids[0] in top, (w.token_ids, top)
        assert abs(top[w.token_ids[0]] - w.logprobs[0].logprob) < 0.1
        assert_no_leak(cudnn)
    assert replays
    assert [o.outputs[0].token_ids for o in cudnn.generate(prompts, greedy(4))] == batch
    # None, "where it works": cuDNN for this model, flash for the fp32 torch-backend one
    assert LLM(model, prefill_attention=None, **kw).config.prefill_attention == "cudnn"
