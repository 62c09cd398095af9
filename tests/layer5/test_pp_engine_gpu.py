"""Pipeline parallelism on GPUs: one GPU per stage (NCCL). With fewer GPUs than stages the
engine refuses at once, naming how many it needs; on two GPUs PP=2 gives PP=1's greedy tokens
(fp32, near-ties aside, shown by the margin)."""
from __future__ import annotations

import pytest
import torch

import layer5_parallel as l5

from .engine_checks import assert_prompts_same_or_near_tie

l3 = l5.engine.executor
PROMPTS = ["ROMEO.\n", "JULIET.\nO Romeo, Romeo", "HAMLET.\nTo be, or not to be", "KING LEAR.\n",
           "MACBETH.\nIs this a dagger", "PORTIA.\nThe quality of mercy", "OTHELLO.\n", "IAGO.\n"]
PARAMS = l5.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.mark.gpu
def test_more_stages_than_gpus_is_refused_clearly():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"pipeline-parallel size {n + 1} on CUDA needs {n + 1} "
                                         rf"GPUs \(one per rank\); {n} are visible"):
        l5.LLM(l3.course_model_dir("target"), device="cuda", dtype="float32", num_blocks=64,
               pipeline_parallel_size=n + 1)


@pytest.mark.multigpu
def test_pp2_nccl_matches_pp1():
    path = l3.course_model_dir("target")
    ref = l5.LLM(path, device="cuda", dtype="float32", num_blocks=256)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, PARAMS)]
    with l5.LLM(path, device="cuda", dtype="float32", num_blocks=256,
                pipeline_parallel_size=2) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert_prompts_same_or_near_tie(ref, PROMPTS, want, got)


@pytest.mark.multigpu
def test_pp2_stage_graphs_match_pp1():
    """cuda_graph=True under PP=2: each stage captures its decode micro-batches and replays
    them; PP=1's greedy tokens (fp32, near-ties aside)."""
    path = l3.course_model_dir("target")
    ref = l5.LLM(path, device="cuda", dtype="float32", num_blocks=256)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, PARAMS)]
    with l5.LLM(path, device="cuda", dtype="float32", num_blocks=256, max_num_seqs=16,
                pipeline_parallel_size=2, pp_micro_batches=2, cuda_graph=True) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        graphs = llm.runner.net.graphs
        assert graphs.captured and graphs.replays > 0
    assert_prompts_same_or_near_tie(ref, PROMPTS, want, got)


@pytest.mark.multigpu
@pytest.mark.parametrize("graphs", [False, True])
def test_steps_in_flight_match_pp1(graphs):
    """pp_steps_in_flight = stages (2, or as many as the GPUs and the course model's 6 layers
    allow, up to 4) over NCCL: lanes of sequences take turns, the logits collected one turn
    later, the broadcast not waited for; PP=1's greedy tokens (fp32, near-ties aside), with
    requests of different lengths and a small pool (preemption)."""
    stages = min(torch.cuda.device_count(), 4)
    path = l3.course_model_dir("target")
    params = [l5.SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    kw = dict(device="cuda", dtype="float32", num_blocks=10, block_size=8, max_num_seqs=8)
    ref = l5.LLM(path, **kw)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params)]
    with l5.LLM(path, pipeline_parallel_size=stages, pp_steps_in_flight=stages,
                cuda_graph=graphs, **kw) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert llm.stats.preemptions > 0
        if graphs:
            assert llm.runner.net.graphs.replays > 0
    assert_prompts_same_or_near_tie(ref, PROMPTS, want, got)
