"""Data parallelism and TP x PP on GPUs: replicas one per GPU, and 4 ranks of 2 x 2.

DP=2 on two GPUs gives one engine's greedy tokens (each replica is that engine); more replicas
than GPUs is refused at once, naming how many it needs. TP=2 x PP=2 on four GPUs (NCCL, each
stage's two shards in a group of their own) gives one process's tokens, near-ties aside.
"""
from __future__ import annotations

import pytest
import torch

import layer5_parallel as l5

l3 = l5.engine.executor
PROMPTS = ["ROMEO.\n", "JULIET.\nO Romeo, Romeo", "HAMLET.\nTo be, or not to be", "KING LEAR.\n",
           "MACBETH.\nIs this a dagger", "PORTIA.\nThe quality of mercy", "OTHELLO.\n", "IAGO.\n"]
PARAMS = l5.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
ENGINE = dict(dtype="float32", num_blocks=256)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.gpu
def test_more_replicas_than_gpus_is_refused_clearly():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"data_parallel_size={n + 1} x 1 rank\(s\) per replica "
                                         rf"needs {n + 1} GPUs; {n} are visible"):
        l5.LLM(l3.course_model_dir("target"), data_parallel_size=n + 1, **ENGINE)


@pytest.mark.multigpu
def test_dp2_on_two_gpus_equals_one_engine():
    path = str(l3.course_model_dir("target"))
    with l5.ReplicaSet(path, data_parallel_size=1, dp_devices=("0",), **ENGINE) as one:
        want = _tokens(one.generate(PROMPTS, PARAMS))
    with l5.LLM(path, data_parallel_size=2, **ENGINE) as dp:
        assert dp.devices == ["0", "1"]
        assert _tokens(dp.generate(PROMPTS, PARAMS)) == want


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="TP=2 x PP=2 needs 4 GPUs")
def test_tp2_pp2_on_four_gpus_matches_one_process():
    path = l3.course_model_dir("target")
    ref = l5.LLM(path, device="cuda", **ENGINE)
    want = _tokens(ref.generate(PROMPTS, PARAMS))
    with l5.LLM(path, device="cuda", tensor_parallel_size=2, pipeline_parallel_size=2,
                **ENGINE) as llm:
        got = _tokens(llm.generate(PROMPTS, PARAMS))
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        if a != b:
            j = next(k for k in range(len(a)) if a[k] != b[k])
            last = ref.prompt_logits([ref.model.encode(PROMPTS[i]) + a[:j]])[0][-1]
            assert float(last[a[j]] - last[b[j]]) < 1e-3, f"prompt {i} token {j}: not a near-tie"
