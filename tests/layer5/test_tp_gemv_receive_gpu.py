"""On 2 GPUs: the TP=2 engine with layer 2's all-reduce, LLM_STACK_TP_GEMV_SEND and
LLM_STACK_TP_GEMV_RECEIVE on (batch 1's o_proj and down GEMVs send their outputs from their
epilogue; gate_up's and the next layer's qkv GEMV receive the sum in their prologue) gives the
same greedy tokens as with both off, CUDA graphs on every rank; and rank 0 did receive inside
both kinds of GEMV."""
from __future__ import annotations

import pytest
import torch

import layer5_parallel as l5

l3 = l5.engine.executor


def _tokens(monkeypatch, on: bool, model, prompts) -> list[list[int]]:
    peer = l5.engine.comm.PeerAllReduce
    for env, attr in ((peer.GEMV_SEND_ENV, "gemv_send"), (peer.GEMV_RECEIVE_ENV, "gemv_receive")):
        # read by the worker rank 0 spawns; rank 0's class attribute was read at its import
        monkeypatch.setenv(env, "1" if on else "0")
        monkeypatch.setattr(peer, attr, on)
    params = l5.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with l5.LLM(model, tensor_parallel_size=2, tp_backend="ours", num_blocks=64, max_num_seqs=8,
                cuda_graph=True, max_model_len=256) as llm:
        assert llm.runner.graph.captured
        return [o.outputs[0].token_ids for p in prompts for o in llm.generate([p], params)]


@pytest.mark.multigpu
def test_gemv_receive_gives_the_same_tokens_as_without(monkeypatch):
    from layer2_comm import gemv_receive

    config = l3.ModelConfig.from_dict(dict(l3.LLAMA_3_2_1B, num_hidden_layers=4))
    model = l3.Model(l3.random_model(config, backend="triton", dtype=torch.bfloat16,
                                     device="cuda", seed=0))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in (5, 33)]
    took: list[str] = []
    for name in ("norm_gemv", "norm_gemv_rope"):
        original = getattr(gemv_receive.PendingSum, name)

        def counted(self, *args, _original=original, _name=name, **kw):  # rank 0's calls
            done = _original(self, *args, **kw)
            took.append(_name if done is not None else f"{_name} declined")
            return done
        monkeypatch.setattr(gemv_receive.PendingSum, name, counted)
    off = _tokens(monkeypatch, False, model, prompts)
    assert not took, "the switches are off: no pending sums"
    on = _tokens(monkeypatch, True, model, prompts)
    assert "norm_gemv" in took and "norm_gemv_rope" in took, f"rank 0 took {set(took)}"
    assert not any("declined" in t for t in took), f"rank 0 took {set(took)}"
    assert on == off
