"""On GPUs: tensor parallelism with layer 2's all-reduce and its decode options on — the fused
norms (each row-parallel all-reduce done by the one-shot kernel together with the residual add
and RMSNorm after it), PDL (the one-shot kernels launched as programmatic dependents, like the
decode GEMVs around them) and LL (small one-shots as data+flag packets) — gives TP=1's greedy
tokens and logits within bf16 tolerance, CUDA graphs on every rank: prefills, decode steps of
one sequence (the fused GEMV path, where PDL and LL matter) and of four (the general path,
where the fused norms run)."""
from __future__ import annotations

import pytest
import torch

import layer5_parallel as l5
from layer5_parallel.tensor_parallel import shard as S

from .test_tp_graph_gpu import BF16_LOGITS_ATOL, BF16_LOGITS_MEAN, bf16_diagnosis

l3 = l5.engine.executor


def _tp_equals_tp1(tp: int) -> None:
    config = l3.ModelConfig.from_dict(dict(l3.LLAMA_3_2_1B, num_hidden_layers=4))
    model = l3.Model(l3.random_model(config, backend="triton", dtype=torch.bfloat16,
                                     device="cuda", seed=0))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist()
               for n in (5, 17, 33, 64)]
    params = l5.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    kw = dict(num_blocks=64, max_num_seqs=8, cuda_graph=True, max_model_len=256)
    ref = l5.LLM(model, **kw)
    runs = (prompts, prompts[1:2])  # four sequences a step, then one
    want = [ref.generate(p, params) for p in runs]
    want_logits = ref.prompt_logits(prompts)
    with l5.LLM(model, tensor_parallel_size=tp, tp_backend="ours", **kw) as llm:
        assert llm.runner.graph.captured
        got = [llm.generate(p, params) for p in runs]
        got_logits = llm.prompt_logits(prompts)
    problems = []
    for i, (w, x) in enumerate(zip(want_logits, got_logits, strict=True)):
        d = (w.float() - x.float()).abs()
        if float(d.max()) > BF16_LOGITS_ATOL or float(d.mean()) > BF16_LOGITS_MEAN:
            problems.append(f"prompt {i}: prefill logits |TP={tp} - TP=1| max "
                            f"{float(d.max()):.3g}, mean {float(d.mean()):.3g}")
    for p, r1, r2 in zip(runs, want, got, strict=True):
        problems += bf16_diagnosis(ref, p, r1, r2, tp)
    assert not problems, "\n".join(problems)


@pytest.mark.multigpu
@pytest.mark.parametrize("switches", [("norms",), ("norms", "pdl", "ll")])
def test_fused_norms_with_our_all_reduce_equal_tp1_tokens(monkeypatch, switches):
    peer = l5.engine.comm.PeerAllReduce
    # read by the workers rank 0 spawns; rank 0's class attributes were read at its import
    monkeypatch.setenv(S.FUSED_NORMS_ENV, "1")
    monkeypatch.setenv(peer.PDL_ENV, "1" if "pdl" in switches else "0")
    monkeypatch.setenv(peer.LL_ENV, "1" if "ll" in switches else "0")
    monkeypatch.setattr(peer, "pdl", "pdl" in switches)
    monkeypatch.setattr(peer, "low_latency", "ll" in switches)
    fused, original = [], peer.fuses_norm

    def counted(self, x):  # rank 0's calls (its eager prefills and the graph captures)
        fused.append(original(self, x))
        return fused[-1]

    monkeypatch.setattr(peer, "fuses_norm", counted)
    lls, launch_ll = [], peer._launch_ll
    monkeypatch.setattr(peer, "_launch_ll", lambda self, x, out: (lls.append(1),
                                                                  launch_ll(self, x, out)))
    _tp_equals_tp1(4 if torch.cuda.device_count() >= 4 else 2)
    assert any(fused), "the fused kernel never ran on rank 0"
    assert bool(lls) == ("ll" in switches), "the LL kernel ran (or not) against the switch"
