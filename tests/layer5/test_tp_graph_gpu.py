"""On two GPUs: TP=2 with CUDA graphs on every rank (NCCL collectives inside the graphs, the
step's inputs broadcast inside them, the step message through shared memory) gives TP=1's
greedy tokens and logprobs within tolerance; a worker that dies or hangs in a graph step
fails rank 0 with one clear error within the timeout, every worker gone."""
from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

import layer5_parallel as l5
from layer5_parallel.tensor_parallel.graphs import TPGraphRunner

from .engine_checks import assert_prompts_same_or_near_tie

l3 = l5.engine.executor
PROMPTS = ["ROMEO.\n", "JULIET.\nO Romeo, Romeo", "HAMLET.\nTo be, or not to be", "KING LEAR.\n",
           "MACBETH.\nIs this a dagger", "PORTIA.\nThe quality of mercy", "OTHELLO.\n", "IAGO.\n",
           "PUCK.\nIf we shadows"]  # 9: buckets 1, 2, 4, 8 and 16 all replay as sequences finish
LOGPROB_ATOL = 2e-3  # fp32; the all-reduce sums in another order (~1e-5 on logits)


def _run(llm):
    # different lengths: the batch shrinks through the buckets as sequences finish
    params = [l5.SamplingParams(temperature=0.0, max_tokens=8 + 2 * i, ignore_eos=True,
                                logprobs=1) for i in range(len(PROMPTS))]
    res = llm.generate(PROMPTS, params)
    return ([o.outputs[0].token_ids for o in res],
            [[lp.logprob for lp in o.outputs[0].logprobs] for o in res])


def _plain_tokens(llm):
    params = l5.SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def _no_workers():
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not [p for p in multiprocessing.active_children() if p.name.startswith("l5-rank")]:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.multigpu
def test_tp2_cuda_graphs_match_tp1_cuda_graphs():
    path = l3.course_model_dir("target")
    kw = dict(dtype="float32", device="cuda", num_blocks=256, max_num_seqs=16, cuda_graph=True)
    ref = l5.LLM(path, **kw)
    want, want_lp = _run(ref)
    want_plain = _plain_tokens(ref)
    with l5.LLM(path, tensor_parallel_size=2, **kw) as tp:
        graph = tp.runner.graph
        assert isinstance(graph, TPGraphRunner) and graph.captured
        assert sorted(graph.graphs) == [1, 2, 4, 8, 16]
        sent = tp.tp_group.ring.count
        got, got_lp = _run(tp)
        got_plain = _plain_tokens(tp)
        assert tp.tp_group.ring.count - sent > 40  # the decode steps went through the ring
    assert_prompts_same_or_near_tie(ref, PROMPTS, want, got)
    assert_prompts_same_or_near_tie(ref, PROMPTS, want_plain, got_plain)
    for a, b, la, lb in zip(want, got, want_lp, got_lp, strict=True):
        n = next((k for k in range(len(a)) if a[k] != b[k]), len(a))
        torch.testing.assert_close(torch.tensor(lb[:n]), torch.tensor(la[:n]),
                                   atol=LOGPROB_ATOL, rtol=0)
    assert _no_workers()


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["torch", "triton"])  # triton: the fused decode kernels
def test_tp2_bf16_llama_shape_graphs_equal_tp1_tokens(backend):
    config = l3.ModelConfig.from_dict(dict(l3.LLAMA_3_2_1B, num_hidden_layers=4))
    model = l3.Model(l3.random_model(config, backend=backend, dtype=torch.bfloat16,
                                     device="cuda", seed=0))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist()
               for n in (5, 17, 33, 64)]
    params = l5.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    kw = dict(num_blocks=64, max_num_seqs=8, cuda_graph=True, max_model_len=256)
    r1 = l5.LLM(model, **kw).generate(prompts, params)
    with l5.LLM(model, tensor_parallel_size=2, **kw) as tp:
        r2 = tp.generate(prompts, params)
    for a, b in zip(r1, r2, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        n = next((k for k in range(len(ta)) if ta[k] != tb[k]), len(ta))
        assert n >= 4, (ta, tb)  # bf16 sums differ in order: late flips at near-ties only
        la = torch.tensor([lp.logprob for lp in a.outputs[0].logprobs[:n]])
        lb = torch.tensor([lp.logprob for lp in b.outputs[0].logprobs[:n]])
        torch.testing.assert_close(lb, la, atol=0.1, rtol=0)


@pytest.mark.multigpu
@pytest.mark.parametrize("fault", ["graph-die", "graph-hang"])
def test_worker_failing_in_a_cuda_graph_step_fails_rank0(fault):
    timeout = 20.0
    config = l3.ModelConfig(model_type="llama", vocab_size=97, hidden_size=64,
                            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    model = l3.Model(l3.random_model(config, seed=2, device="cuda"))
    llm = l5.LLM(model, tensor_parallel_size=2, cuda_graph=True, num_blocks=32, max_num_seqs=4,
                 tp_timeout_s=timeout, _tp_faults={1: fault})
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor-parallel") as info:
        llm.generate([[1, 2, 3], [4, 5]], l5.SamplingParams(temperature=0.0, max_tokens=4))
    elapsed = time.monotonic() - start
    llm.close()
    assert elapsed < timeout + 10, elapsed
    if fault == "graph-die":
        assert "rank 1" in str(info.value), str(info.value)
    else:
        assert "within" in str(info.value), str(info.value)
    assert _no_workers()
