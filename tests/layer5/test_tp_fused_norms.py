"""A tensor-parallel shard whose norms do the row-parallel all-reduces (fuse_norms): o_proj
and down return their partial products and the RMSNorm after each (ReducingRMSNorm) sums them,
adds the residual and normalises — on GPUs with layer 2's all-reduce one kernel. On CPU ranks
(gloo) the same modules run the all-reduce and then the norm: the shard must compute what the
whole model computes, prefill and decode, at awkward sizes (hidden 48, batches 1 and 3), with
both collective backends. The fused kernel itself: tests/layer2/test_peer_norm.py (multigpu)."""
from __future__ import annotations

import pytest
import torch

import layer5_parallel as l5
from layer2_comm import launch
from layer5_parallel.tensor_parallel import shard as S

l3 = l5.engine.executor
TINY = dict(l3.LLAMA_3_2_1B, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=97,
            tie_word_embeddings=False)


def _steps(net, lens: list[int]) -> list[torch.Tensor]:
    """Logits of a prefill of len(lens) prompts, then two decode steps of every sequence."""
    cache = l3.ContiguousKVCache.for_model(net.config, len(lens), 32, dtype=net.dtype,
                                           device="cpu")
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, net.config.vocab_size, (sum(lens),), generator=g)
    out = [net(prompt, cache.context(lens, [0] * len(lens)), cache, last_only=True)]
    for i in range(2):
        tokens = out[-1].argmax(-1)
        out.append(net(tokens, cache.context([1] * len(lens), [n + i for n in lens]), cache,
                       last_only=True))
    return out


def _rank(backend: str) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    net = l3.random_model(l3.ModelConfig.from_dict(TINY), seed=11, std=0.3)
    result = {}
    for fuse in (False, True):
        comm = l5.TPComm(backend)
        shard = S.shard_model(net, rank, world, comm, fuse_norms=fuse)
        norms = sum(isinstance(m, S.ReducingRMSNorm) for m in shard.modules())
        deferred = sum(isinstance(m, S.RowParallelLinear) and not m.reduce
                       for m in shard.modules())
        with torch.no_grad():
            for lens in ([5], [4, 3, 1]):
                want, got = _steps(net, lens), _steps(shard, lens)
                result[(fuse, len(lens))] = max((a - b).abs().max().item()
                                                for a, b in zip(want, got, strict=True))
        result[(fuse, "norms")], result[(fuse, "deferred")] = norms, deferred
        if fuse:  # the training path would add unreduced partial sums: refused
            try:
                shard(torch.zeros(1, 4, dtype=torch.int64))
                result["training"] = "no error"
            except ValueError as exc:
                result["training"] = str(exc)
    return result


@pytest.mark.usefixtures("fork_server")  # layer 2's launch (tests/conftest.py)
@pytest.mark.parametrize("backend", ["torch", "ours"])
def test_a_shard_with_fused_norms_computes_the_whole_model(backend):
    for r in launch(_rank, 2, backend, backend="gloo", timeout_s=300):
        layers = TINY["num_hidden_layers"]
        assert r[(False, "norms")] == 0 and r[(False, "deferred")] == 0
        # every o_proj and down: its own layer's mlp_norm, the next attn_norm, the final norm
        assert r[(True, "norms")] == 2 * layers and r[(True, "deferred")] == 2 * layers
        for fuse in (False, True):
            for batch in (1, 3):
                assert r[(fuse, batch)] < 1e-4, (fuse, batch, r)
        assert "serving forward only" in r["training"]


def test_the_default_is_on_where_it_is_one_kernel(monkeypatch):
    class Comm:
        def __init__(self, backend):
            self.backend = backend

    monkeypatch.delenv(S.FUSED_NORMS_ENV, raising=False)
    assert S.fused_norms_default(Comm("ours"), "cuda:0")  # layer 2's fused kernel
    assert not S.fused_norms_default(Comm("ours"), "cpu")  # gloo: nothing to fuse
    assert not S.fused_norms_default(Comm("torch"), "cuda:0")  # NCCL: nothing to fuse
    assert not S.fused_norms_default()
    monkeypatch.setenv(S.FUSED_NORMS_ENV, "0")
    assert not S.fused_norms_default(Comm("ours"), "cuda:0")
    monkeypatch.setenv(S.FUSED_NORMS_ENV, "1")
    assert S.fused_norms_default(Comm("torch"), "cpu")
    monkeypatch.setenv(S.FUSED_NORMS_ENV, "yes")  # a typo is an error, not silently off
    with pytest.raises(ValueError, match="must be 0 or 1"):
        S.fused_norms_default(Comm("ours"), "cuda:0")
