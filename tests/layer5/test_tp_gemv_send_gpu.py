"""On 2 (and 4) GPUs: the TP=2 (TP=4) engine with layer 2's all-reduce and LLM_STACK_TP_GEMV_SEND on (batch 1's
o_proj and down GEMVs send their outputs to the peer from their epilogue) gives the same greedy
tokens as with it off, CUDA graphs on every rank; and it did take the fused path on rank 0."""
from __future__ import annotations

import pytest
import torch

import layer5_parallel as l5

l3 = l5.engine.executor


def _tokens(monkeypatch, on: bool, model, prompts, tp: int) -> list[list[int]]:
    peer = l5.engine.comm.PeerAllReduce
    # read by the worker rank 0 spawns; rank 0's class attribute was read at its import
    monkeypatch.setenv(peer.GEMV_SEND_ENV, "1" if on else "0")
    monkeypatch.setattr(peer, "gemv_send", on)
    params = l5.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with l5.LLM(model, tensor_parallel_size=tp, tp_backend="ours", num_blocks=64, max_num_seqs=8,
                cuda_graph=True, max_model_len=256) as llm:
        assert llm.runner.graph.captured
        return [o.outputs[0].token_ids for p in prompts for o in llm.generate([p], params)]


@pytest.mark.multigpu
@pytest.mark.parametrize("tp", [2, 4])
def test_gemv_send_gives_the_same_tokens_as_without(monkeypatch, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"TP={tp} needs {tp} GPUs; {torch.cuda.device_count()} visible")
    config = l3.ModelConfig.from_dict(dict(l3.LLAMA_3_2_1B, num_hidden_layers=4))
    model = l3.Model(l3.random_model(config, backend="triton", dtype=torch.bfloat16,
                                     device="cuda", seed=0))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in (5, 33)]
    peer = l5.engine.comm.PeerAllReduce
    sent, original = [], peer.gemv_all_reduce

    def counted(self, x, w, silu=False, **kw):  # rank 0's calls (eager steps, graph captures)
        sent.append(self.sends_from_gemv(x, w, silu))
        return original(self, x, w, silu, **kw)

    monkeypatch.setattr(peer, "gemv_all_reduce", counted)
    off = _tokens(monkeypatch, False, model, prompts, tp)
    assert not sent, "the switch is off: TPComm must leave the GEMV to layer 3"
    on = _tokens(monkeypatch, True, model, prompts, tp)
    assert sent and all(sent), "the fused path never ran (or fell back) on rank 0"
    assert on == off
