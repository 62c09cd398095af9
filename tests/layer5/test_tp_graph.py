"""The tensor-parallel decode-graph path on gloo: the runner every rank replays CUDA graphs
with on a GPU (tensor_parallel/graphs.py) runs the same static-buffer steps eagerly on a CPU,
so CI checks that its in-step input broadcast and the shared-memory step messages give TP=1's
tokens, and that a worker that hangs or dies mid-step (a graph step, or an eager one) fails
rank 0 clearly within the step limit.
"""
from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

import layer5_parallel as l5
from layer5_parallel.tensor_parallel.graphs import TPGraphRunner

l3 = l5.engine.executor
# The start-up limit: room for the workers to start on a busy machine (past 10 s there).
START_TIMEOUT_S = 120.0
# The step limit: a net (a death or a good run ends long before it) ...
TIMEOUT_S = 60.0
# ... and where a hanging worker is found only when it runs out, a short one. It counts only
# once every rank is up, so however slowly the workers start, a step never nears it.
HANG_TIMEOUT_S = 3.0


def model() -> l3.Model:
    config = l3.ModelConfig(model_type="qwen2", vocab_size=211, hidden_size=64,
                            intermediate_size=90, num_hidden_layers=2, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=8, qkv_bias=True,
                            max_position_embeddings=128)
    return l3.Model(l3.random_model(config, seed=1, std=0.3))


def prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 211, (k,), generator=g).tolist()
            for k in torch.randint(3, 21, (n,), generator=g).tolist()]


PARAMS = l5.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_graph_path_on_gloo_gives_tp1_tokens():
    m, ps = model(), prompts()
    kw = dict(num_blocks=64, block_size=8, max_num_seqs=8)
    ref = [o.outputs[0].token_ids for o in l5.LLM(m, **kw).generate(ps, PARAMS)]
    with l5.LLM(m, tensor_parallel_size=2, cuda_graph=True, tp_timeout_s=TIMEOUT_S,
                tp_start_timeout_s=START_TIMEOUT_S, **kw) as tp:
        graph = tp.runner.graph
        assert isinstance(graph, TPGraphRunner) and not graph.captured
        assert graph.buckets == [1, 2, 4, 8]
        before = tp.tp_group.ring.count
        got = [o.outputs[0].token_ids for o in tp.generate(ps, PARAMS)]
        messages = tp.tp_group.ring.count - before
    assert got == ref
    # one prefill step, then one graph step per decode step: 5 decode steps of 6 sequences
    assert messages >= 6
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("l5-rank")]


FAULTY = dict(tensor_parallel_size=2, cuda_graph=True, num_blocks=32, block_size=8,
              max_num_seqs=4, tp_start_timeout_s=START_TIMEOUT_S)


@pytest.mark.parametrize("fault", ["graph-hang", "graph-die", "hang"])  # hang: an eager step
def test_worker_failing_mid_step_fails_rank0_within_the_step_limit(fault):
    timeout_s = HANG_TIMEOUT_S if fault.endswith("hang") else TIMEOUT_S
    llm = l5.LLM(model(), tp_timeout_s=timeout_s, _tp_faults={1: fault}, **FAULTY)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor-parallel") as info:
        llm.generate([[1, 2, 3], [4, 5]], PARAMS)
    elapsed = time.monotonic() - start
    llm.close()
    assert elapsed < timeout_s + 10, elapsed
    if fault == "graph-die":
        assert "rank 1" in str(info.value) and "code 3" in str(info.value), str(info.value)
    else:  # the limit that ran out, named as what it is
        assert "the step limit of 3 s (tp_timeout_s)" in str(info.value), str(info.value)
        assert "start-up" not in str(info.value), str(info.value)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and [p for p in multiprocessing.active_children()
                                           if p.name.startswith("l5-rank")]:
        time.sleep(0.1)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("l5-rank")]
