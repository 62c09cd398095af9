"""A tensor-parallel shard keeps layer 3's fused decode kernels (triton backend): its
row-parallel and vocab-parallel linears finish the fused GEMV's output with their own
collective (`combine`), so a shard decodes through the same few kernels per layer as the
whole model. CPU: Triton's interpreter, fp32, a one-rank gloo group (its collectives are the
identity, so the shard's logits equal the model's); two GPUs: tests/layer5/test_tp_graph_gpu.py."""
from __future__ import annotations

import dataclasses
import importlib
from datetime import timedelta

import torch
import torch.distributed as dist

import layer5_parallel as l5
from layer3_model import backends
from layer5_parallel.tensor_parallel.shard import RowParallelLinear

l3 = l5.engine.executor
GEMV = importlib.import_module("layer1_kernels.gemv")  # (the package's `gemv` is the function)
GEMV_ROPE = importlib.import_module("layer1_kernels.gemv_rope")
TINY = dict(l3.LLAMA_3_2_1B, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=97,
            tie_word_embeddings=False)


def _decode(net, steps: int = 3, decode_ops=None) -> list[torch.Tensor]:
    """The prefill through torch's ops (not under test, and slow interpreted), then `steps`
    decode steps through decode_ops (default: the net's own); the net's ops are put back."""
    own = net.ops
    cache = l3.ContiguousKVCache.for_model(net.config, 2, 32, dtype=net.dtype, device="cpu")
    prompt, lens = torch.tensor([1, 2, 3, 4, 5, 6, 7]), [4, 3]
    try:
        net.ops = l3.make_ops("torch")
        logits = net(prompt, cache.context(lens, [0, 0]), cache, last_only=True)
        net.ops = decode_ops or own
        tokens, out = logits.argmax(-1), []
        for i in range(steps):
            logits = net(tokens, cache.context([1, 1], [n + i for n in lens]), cache,
                         last_only=True)
            out.append(logits)
            tokens = logits.argmax(-1)
    finally:
        net.ops = own
    return out


def test_a_shard_takes_the_fused_decode_path(monkeypatch):
    calls = []
    original = backends.DecodeKernels.linear

    def counted(self, x, linear):
        calls.append(type(linear).__name__)
        return original(self, x, linear)

    monkeypatch.setattr(backends.DecodeKernels, "linear", counted)
    # Wider GEMV tiles than the interpreter's default (4 rows, 2 pairs), as
    # tests/layer3/test_fused_decode.py's: the interpreter's cost is per program, and these
    # still cut every product into several (vocab 97 = 6 x 16 + 1, qkv 128 and gate_up 160
    # rows, K 48 and 80 in 16-wide steps; gemv_rope's 4 pairs are half a head).
    monkeypatch.setattr(GEMV, "_default_config", lambda n, k, rows: (16, 16, 1))
    monkeypatch.setattr(GEMV_ROPE, "_default_config", lambda k: (4, 16, 1))
    net = l3.random_model(l3.ModelConfig.from_dict(TINY), backend="triton", seed=3, std=0.3)
    net.set_backend("triton", impl="triton")
    store = dist.HashStore()
    pg = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=30))
    shard = l5.shard_model(net, 0, 1, l5.TPComm("torch", pg=pg))
    shard.set_backend("triton", impl="triton")
    shard.ops = dataclasses.replace(  # two sequences: more than the default limit takes
        shard.ops, decode=dataclasses.replace(shard.ops.decode, max_tokens=2))
    comm = shard.layers[0].attn.o_proj.comm
    want = _decode(net, decode_ops=l3.make_ops("torch"))  # the whole model, torch's kernels
    before = comm.calls
    got = _decode(shard)
    assert "RowParallelLinear" in calls  # o_proj through the fused GEMV, then its all-reduce
    # per decode step: embedding + 2 per layer all-reduces and the logits' all-gather
    assert comm.calls - before >= 3 * (1 + 2 * 2 + 1)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)


def test_a_row_parallel_linear_with_a_bias_is_not_fused():
    lin = torch.nn.Linear(4, 4)

    class Row(torch.nn.Module):
        def __init__(self, bias):
            super().__init__()
            self.weight, self.bias = lin.weight, bias

        def combine(self, y):
            return y

    assert backends._fusable(Row(None), torch.float32)
    assert not backends._fusable(Row(lin.bias), torch.float32)  # the bias comes after the sum
    assert not backends._fusable(Row(None), torch.bfloat16)
    assert backends._fusable(lin, torch.float32)


def test_row_parallel_gemv_combined_is_the_comms_or_none():
    """RowParallelLinear.gemv_combined hands its GEMV and all-reduce to the comm; a comm
    without the fused path (torch's collectives, or ours on CPU tensors) answers None, and
    layer 3 then runs its GEMV and combine as before."""
    w = torch.randn(6, 4)
    seen = []

    class Comm:
        def gemv_all_reduce(self, x, weight, silu):
            seen.append((x, weight, silu))
            return "summed"

    x = torch.randn(1, 4)
    row = RowParallelLinear(w, None, Comm())
    assert row.gemv_combined(x, True) == "summed"
    assert seen[0][0] is x and seen[0][1] is row.weight and seen[0][2] is True
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))
    for backend in ("torch", "ours"):
        comm = l5.TPComm(backend, pg=pg) if backend == "torch" else object.__new__(l5.TPComm)
        comm.backend = backend
        assert comm.gemv_all_reduce(x, w, False) is None
