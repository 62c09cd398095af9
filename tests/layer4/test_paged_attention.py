"""paged_decode_attention: our Triton kernel (interpreted on CPU, compiled on GPU) and its torch
reference against a float64 attention computed one token at a time from the block tables.

Every cache slot a query must not look at (unreferenced blocks, the tail of a sequence's
last block, table padding, keys outside a sliding window) holds NaN: one stray read shows."""
from __future__ import annotations

import pytest
import torch

import layer3_model as l3
from layer4_algorithms.kv.paged_attention import (
    decode_bytes_and_flops,
    paged_decode_attention,
    paged_decode_attention_reference,
    pick_num_splits,
)

from ..paged_case import make_case


def dense_float64(case: dict) -> torch.Tensor:
    """Attention of each sequence's one query over its visible keys, looked up token by token."""
    q, k_cache, v_cache = (case[n].double().cpu() for n in ("q", "k_cache", "v_cache"))
    tables, block_size = case["block_tables"].cpu(), k_cache.shape[1]
    B, Hq, D = q.shape
    group = Hq // k_cache.shape[2]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b, n in enumerate(case["seq_lens"].tolist()):
        lo = 0 if case["window"] is None else max(0, n - case["window"])
        if n <= lo:
            continue
        j = torch.arange(lo, n)
        blk, row = tables[b, j // block_size].long(), j % block_size
        keys, values = k_cache[blk, row], v_cache[blk, row]  # (n - lo, Hkv, D), token by token
        for h in range(Hq):
            p = torch.softmax(keys[:, h // group] @ q[b, h] * case["scale"], dim=0)
            out[b, h] = p @ values[:, h // group]
    return out


def run(case: dict, impl: str, **kwargs) -> torch.Tensor:
    return paged_decode_attention(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                                  case["seq_lens"], case["scale"], case["window"], impl, **kwargs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


# (seq_lens, q_heads, kv_heads, head_dim, block_size, window): odd batches, lengths that are
# not multiples of the block size, GQA groups 1, 4 and 5, windows shorter and longer than a block.
CASES = [
    ([37, 1, 22], 4, 4, 16, 8, None),        # MHA (group 1), a 1-token sequence
    ([50, 17, 33, 9, 64], 16, 4, 32, 16, None),  # group 4, B = 5
    ([70, 33], 10, 2, 16, 32, 9),             # group 5 (padded to 16 rows), window < block
    ([45, 12, 29], 8, 2, 64, 8, 20),          # window across blocks, D = 64
    ([13], 8, 1, 16, 1, None),                # MQA, one token per block
]


@pytest.mark.parametrize("seq_lens,hq,hkv,d,bs,window", CASES)
def test_reference_matches_float64(seq_lens, hq, hkv, d, bs, window):
    case = make_case(seq_lens, hq, hkv, d, bs, window=window, table_dtype=torch.int32)
    out = run(case, "torch")
    assert out.shape == case["q"].shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert rel_err(out, dense_float64(case)) < 1e-5


@pytest.mark.interpreter
@pytest.mark.parametrize("seq_lens,hq,hkv,d,bs,window", CASES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_kernel_matches_float64(seq_lens, hq, hkv, d, bs, window, num_splits):
    case = make_case(seq_lens, hq, hkv, d, bs, window=window, seed=len(seq_lens) + bs)
    out = run(case, "triton", num_splits=num_splits)
    assert out.shape == case["q"].shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    ref = dense_float64(case)
    assert rel_err(out, ref) < 1e-5
    torch.testing.assert_close(out, run(case, "torch"), rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
def test_more_splits_than_blocks_and_int32_indices():
    """Parts past a sequence's end are empty (lse = -inf) and drop out of the merge."""
    case = make_case([5, 40, 1], 8, 2, 16, 16, table_dtype=torch.int32, seed=7)
    ref = dense_float64(case)
    for splits in (2, 8):
        assert rel_err(run(case, "triton", num_splits=splits), ref) < 1e-5


@pytest.mark.interpreter
def test_fp16_and_strided_q():
    case = make_case([29, 6, 18], 8, 2, 32, 8, dtype=torch.float16, seed=5)
    # q as the model makes it: a (T, Hq, D) view into a wider qkv row
    qkv = torch.randn(3, 8 * 32 + 2 * 2 * 32).half()
    qkv[:, :256] = case["q"].reshape(3, 256)
    case["q"] = qkv[:, :256].view(3, 8, 32)
    assert not case["q"].is_contiguous()
    for splits in (1, 2):
        out = run(case, "triton", num_splits=splits)
        assert out.dtype == torch.float16
        assert rel_err(out, dense_float64(case)) < 2e-3


@pytest.mark.interpreter
def test_empty_sequence_and_clamped_length_give_finite_results():
    """seq_len 0 -> output 0; a seq_len past the table's capacity is clamped (no stray read)."""
    case = make_case([0, 7], 4, 2, 16, 8, seed=9)
    case["k_cache"][case["block_tables"][1, 0], 7:] = 0.0  # the clamped tail: finite, not written
    case["v_cache"][case["block_tables"][1, 0], 7:] = 0.0
    case["seq_lens"] = torch.tensor([0, 999])  # table holds one block: positions < 8 only
    for impl in ("triton", "torch"):
        for splits in (1, 3):
            out = run(case, impl, num_splits=splits) if impl == "triton" else run(case, impl)
            assert torch.isfinite(out).all()
            assert (out[0] == 0).all()
    clamped = dict(case, seq_lens=torch.tensor([0, 8]))
    torch.testing.assert_close(run(case, "triton"), run(clamped, "torch"), rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
def test_bf16_is_refused_by_the_interpreter():
    case = make_case([5], 4, 2, 16, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16"):
        run(case, "triton")


def test_auto_runs_the_reference_on_cpu_and_bad_inputs_are_named():
    case = make_case([9, 4], 4, 2, 16, 8)
    torch.testing.assert_close(run(case, "auto"), run(case, "torch"), rtol=0, atol=0)
    bad = [
        (dict(q=case["q"][0]), "3-D"),
        (dict(q=case["q"][:, :3]), "multiple of kv heads"),
        (dict(block_tables=case["block_tables"].float()), "int32 or int64"),
        (dict(seq_lens=case["seq_lens"][:1]), "seq_lens must be"),
        (dict(v_cache=case["v_cache"][:, :4]), "k_cache and v_cache"),
        (dict(q=case["q"].double()), "dtypes differ"),
        (dict(scale=0.0), "scale must be positive"),
        (dict(window=0), "window"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            run(dict(case, **change), "torch")
    with pytest.raises(ValueError, match="unknown impl"):
        run(case, "cuda")
    with pytest.raises(ValueError, match="head dim 24"):
        run(make_case([3], 2, 1, 24, 8), "triton")


def test_split_count_and_cost_model():
    cpu = torch.device("cpu")
    assert pick_num_splits(1, 8, 16, cpu) == 1  # short context: one part
    assert pick_num_splits(1, 1, 4096, cpu) == 4  # "one SM": 4 programs wanted
    assert pick_num_splits(1, 1, 40, cpu) == 2  # ... but no part under 16 keys (a power of 2)
    assert pick_num_splits(64, 8, 4096, cpu) == 1
    splits = l3.comm.kernels.paged_decode_splits  # on 132 SMs (H100, H200)
    # at most: the kernel cuts each sequence by its length (D 64's 128-key steps: 8 parts of
    # 1k keys at batch 1-8, as the H100 sweep picked)
    assert [splits(b, 8, n, 132) for b, n in [(1, 1024), (4, 1024), (8, 1024), (1, 4096),
                                              (4, 4096), (1, 16384), (4, 16384), (8, 16384)]] \
        == [32, 16, 8, 32, 16, 32, 16, 8]  # batch 1: one wave of 32-part merges
    assert splits(1, 8, 272, 132) == splits(1, 2, 272, 132) == 16  # a graph for 272 tokens
    assert splits(1, 8, 1024, 132, min_part=128) == 8
    assert splits(32, 8, 4096, 132) == 1  # 1.94 programs per SM: one part up to 4k keys
    assert splits(32, 8, 16384, 132) == 2  # ... two past it (H200 sweep)
    assert splits(32, 8, 4096, 132, head_dim=128) == 1  # D 128: 2 programs fit an SM
    assert splits(48, 8, 4096, 132) == splits(256, 8, 2112, 132) == 1  # >= 2.5 per SM
    nbytes, flops = decode_bytes_and_flops(2, 100, 32, 8, 64, 2)
    assert nbytes == 2 * 2 * 32 * 64 * 2 + 2 * 2 * 100 * 8 * 64 * 2
    assert flops == 4 * 2 * 100 * 32 * 64
    assert decode_bytes_and_flops(2, 100, 32, 8, 64, 2, window=10)[1] == 4 * 2 * 10 * 32 * 64


def test_reference_is_graph_safe_shapes_only():
    """The reference reads no device value on the host: changing seq_lens changes the result
    without changing any shape (it could be captured in a CUDA graph too)."""
    case = make_case([20, 20], 4, 2, 16, 8)
    short = dict(case, seq_lens=torch.tensor([12, 3]))
    a, b = run(case, "torch"), run(short, "torch")
    assert a.shape == b.shape and not torch.allclose(a, b)
    assert rel_err(b, dense_float64(short)) < 1e-5


# ---- GPU: the compiled kernel at real sizes ------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,batch,max_len,window,block_size", [  # (each variant compiles)
    (torch.bfloat16, 1, 4096, None, 16), (torch.float16, 8, 2000, None, 32),
    (torch.bfloat16, 33, 700, 256, 16), (torch.bfloat16, 4, 9000, None, 16),
    (torch.float16, 4, 9000, None, 16), (torch.bfloat16, 300, 600, None, 16)])
def test_gpu_matches_reference(dtype, batch, max_len, window, block_size):
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    lens[0] = max_len
    case = make_case(lens, 32, 8, 64, block_size, window=window, dtype=dtype, device="cuda",
                     seed=batch)
    ref = dense_float64(case)
    for splits in (None, 1, 4):
        out = run(case, "auto", num_splits=splits)
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert rel_err(out, ref) < 1e-2, splits


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,group", [(128, 4), (32, 1), (64, 5), (256, 2)])
def test_gpu_head_dims_groups_and_fp32(head_dim, group):
    case = make_case([300, 1, 77], 2 * group, 2, head_dim, 16, device="cuda", seed=head_dim)
    assert rel_err(run(case, "triton"), dense_float64(case)) < 1e-5
    half = dict(case, **{n: case[n].half() for n in ("q", "k_cache", "v_cache")})
    assert rel_err(run(half, "triton"), dense_float64(half)) < 2e-3


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_follows_the_device_inputs():
    """Captured once, replayed with new seq_lens and block tables copied into the same tensors."""
    case = make_case([500, 1200, 64], 32, 8, 64, 16, dtype=torch.bfloat16, device="cuda", seed=3)
    args = [case[n] for n in ("q", "k_cache", "v_cache", "block_tables", "seq_lens")]
    paged_decode_attention(*args, case["scale"])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(*args, case["scale"])
    graph.replay()
    assert rel_err(out, dense_float64(case)) < 1e-2
    case["seq_lens"].copy_(torch.tensor([17, 1100, 64]))
    # sequences 0 and 2 swap blocks
    case["block_tables"][[0, 2]] = case["block_tables"][[2, 0]].clone()
    case["k_cache"].nan_to_num_(0.0)
    case["v_cache"].nan_to_num_(0.0)  # now every slot is finite: any table entry may be read
    graph.replay()
    ref = paged_decode_attention_reference(*args, case["scale"])
    assert rel_err(out, ref.double().cpu()) < 1e-2


def test_bench_runs_its_code_on_cpu(monkeypatch, capsys):
    """The GPU benchmark's own code (cases, SDPA layouts, rows, table) on tiny CPU inputs,
    with a fake timer, so the lead's GPU run does not find a typo."""
    import triton.testing

    from layer4_algorithms.bench import paged_attention as bench

    monkeypatch.setattr(bench, "_DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 0.002)[1])
    monkeypatch.setattr(bench.l3, "load_ceilings", lambda *a,
                        **k: type("C", (), {"memory_bandwidth": 1e12})())
    rows = bench.bench_paged_decode(batches=(1, 3), contexts=(40,), q_heads=4, kv_heads=2,
                                    head_dim=16,
                                    block_size=8, dtype=torch.float32, splits=(None, 2))
    assert [(r["batch"], r["num_splits"], r["auto"]) for r in rows] == [(1, 1, True), (1, 2, False),
                                                                        (3, 1, True), (3, 2, False)]
    for r in rows:
        assert r["max_abs_diff"] < 1e-5 and r["speedup"] == pytest.approx(1.0)
        nbytes = decode_bytes_and_flops(r["batch"], 40, 4, 2, 16, 4)[0]
        assert r["gbps"] == pytest.approx(nbytes / 2e-6 / 1e9)
        assert r["of_copy"] == pytest.approx(r["gbps"] / 1e3)
    assert "sdpa/ours" in capsys.readouterr().out


def test_bench_graph_columns_say_why_empty_on_cpu(monkeypatch):
    """Off a GPU the CUDA-graph replay columns are None with the reason, and the rows keep
    their do_bench figures."""
    import triton.testing

    from layer4_algorithms.bench import paged_attention as bench

    monkeypatch.setattr(bench, "_DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 0.002)[1])
    monkeypatch.setattr(bench.l3, "load_ceilings", lambda *a,
                        **k: type("C", (), {"memory_bandwidth": 1e12})())
    rows = bench.bench_paged_decode(batches=(2,), contexts=(24,), q_heads=4, kv_heads=2,
                                    head_dim=16, block_size=8, dtype=torch.float32,
                                    verbose=False)
    assert rows and all(r["ours_graph_us"] is None and r["graph_speedup"] is None
                        and r["graph_note"] == bench.GRAPH_SKIPPED for r in rows)
