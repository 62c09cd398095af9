"""flash_attention_varlen: many sequences of different lengths in one launch (interpreted on
CPU), packed rows and paged / contiguous caches, against math attention in float64."""
from __future__ import annotations

import pytest
import torch

from layer1_kernels.flash_attention import flash_attention_reference
from layer1_kernels.flash_attention_varlen import flash_attention_varlen


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def starts_of(query_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])


def fused_rows(T: int, hq: int, hkv: int, d: int, gen: torch.Generator, dtype=torch.float32):
    """q (T, hq, d) and k, v (T, hkv, d) as strided views of qkv-like rows; out with gaps."""
    rows = torch.randn(T, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q = rows[:, :hq * d].view(T, hq, d)
    k = rows[:, hq * d:(hq + hkv) * d].view(T, hkv, d)
    v = rows[:, (hq + hkv) * d:].view(T, hkv, d)
    out = torch.full((T, hq, 2 * d), float("nan"), dtype=dtype)[..., :d]
    return q, k, v, out


def exact_seq(q_rows, keys, values) -> torch.Tensor:
    """One sequence in float64: q (n_q, Hq, D) the last n_q positions of keys (n_k, Hkv, D)."""
    o = flash_attention_reference(q_rows.double().transpose(0, 1)[None],
                                  keys.double().transpose(0, 1)[None],
                                  values.double().transpose(0, 1)[None], causal=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("query_lens,hq,hkv,d", [([5, 1, 37], 4, 2, 16), ([70], 2, 1, 32),
                                                 ([1, 1, 2], 4, 4, 16), ([17, 64, 3], 4, 1, 64)])
@pytest.mark.interpreter
def test_packed_prefill_matches_float64(query_lens, hq, hkv, d) -> None:
    gen = torch.Generator().manual_seed(sum(query_lens) + d)
    T = sum(query_lens)
    q, k, v, out = fused_rows(T, hq, hkv, d, gen)
    starts = starts_of(query_lens)
    got = flash_attention_varlen(q, k, v, out, starts, torch.tensor(query_lens),
                                 max(query_lens), impl="triton")
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(out).all()
    for b in range(len(query_lens)):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        assert rel_err(out[rows], exact_seq(q[rows], k[rows], v[rows])) < 1e-5
    alt = torch.empty_like(q)
    flash_attention_varlen(q, k, v, alt, starts, torch.tensor(query_lens), max(query_lens),
                           impl="torch")
    assert rel_err(alt, out) < 1e-5


def paged_case(query_lens, context_lens, hq, hkv, d, page, seed, dtype=torch.float32):
    """A paged cache holding every sequence's keys in shuffled blocks (plus spare blocks of
    noise), the flat queries of this step, and each sequence's keys in order (the truth)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    per_seq = [-(-n // page) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    k_pool = torch.randn(num_blocks, page, hkv, d, generator=gen).to(dtype)
    v_pool = torch.randn(num_blocks, page, hkv, d, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(per_seq) + 1, dtype=torch.int64)
    keys, values = [], []
    for b, n in enumerate(per_seq):
        blocks = [order.pop() for _ in range(n)]
        tables[b, :n] = torch.tensor(blocks)
        keys.append(k_pool[blocks].reshape(-1, hkv, d)[:seq_lens[b]])
        values.append(v_pool[blocks].reshape(-1, hkv, d)[:seq_lens[b]])
    q, _, _, out = fused_rows(sum(query_lens), hq, hkv, d, gen, dtype)
    return q, out, k_pool, v_pool, tables, torch.tensor(seq_lens), keys, values


@pytest.mark.parametrize("query_lens,context_lens,page", [
    ([3, 1, 20], [30, 7, 0], 16),       # a chunk after a prefix, a decode, a fresh prompt
    ([1, 1, 1, 9], [40, 0, 5, 13], 5),  # mostly decodes; a page that is not a power of two
    ([33], [100], 8)])                  # one chunk over a long prefix
@pytest.mark.interpreter
def test_paged_matches_float64(query_lens, context_lens, page) -> None:
    hq, hkv, d = 4, 2, 16
    q, out, k_pool, v_pool, tables, seq_lens, keys, values = paged_case(
        query_lens, context_lens, hq, hkv, d, page, seed=page)
    starts = starts_of(query_lens)
    flash_attention_varlen(q, k_pool, v_pool, out, starts, seq_lens, max(query_lens),
                           block_tables=tables, paged=True, impl="triton")
    assert torch.isfinite(out).all()
    for b in range(len(query_lens)):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        assert rel_err(out[rows], exact_seq(q[rows], keys[b], values[b])) < 1e-5
    alt = torch.empty_like(q)
    flash_attention_varlen(q, k_pool, v_pool, alt, starts, seq_lens, max(query_lens),
                           block_tables=tables, paged=True, impl="torch")
    assert rel_err(alt, out) < 1e-5


@pytest.mark.interpreter
def test_contiguous_rows_without_tables() -> None:
    """block_tables None: sequence b is row b of a (batch, max_len, Hkv, D) cache, here a
    transposed (B, Hkv, S, D) view (what a cache's `read` returns), read through its strides."""
    gen = torch.Generator().manual_seed(7)
    query_lens, context_lens, hq, hkv, d, max_len = [4, 1, 11], [9, 20, 0], 4, 2, 32, 24
    padded_k = torch.randn(3, hkv, max_len, d, generator=gen)
    padded_v = torch.randn(3, hkv, max_len, d, generator=gen)
    k_rows, v_rows = padded_k.transpose(1, 2), padded_v.transpose(1, 2)  # (B, S, Hkv, D)
    q, _, _, out = fused_rows(sum(query_lens), hq, hkv, d, gen)
    seq_lens = [a + b for a, b in zip(query_lens, context_lens, strict=True)]
    starts = starts_of(query_lens)
    flash_attention_varlen(q, k_rows, v_rows, out, starts, torch.tensor(seq_lens),
                           max(query_lens), paged=True, impl="triton")
    for b in range(3):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        ref = exact_seq(q[rows], k_rows[b, :seq_lens[b]], v_rows[b, :seq_lens[b]])
        assert rel_err(out[rows], ref) < 1e-5


@pytest.mark.interpreter
def test_fp16_close_to_float64() -> None:
    q, out, k_pool, v_pool, tables, seq_lens, keys, values = paged_case(
        [6, 1], [10, 3], 4, 1, 32, 16, seed=3, dtype=torch.float16)
    starts = starts_of([6, 1])
    flash_attention_varlen(q, k_pool, v_pool, out, starts, seq_lens, 6, block_tables=tables,
                           paged=True, impl="triton")
    assert out.dtype == torch.float16
    for b in range(2):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        assert rel_err(out[rows], exact_seq(q[rows], keys[b], values[b])) < 2e-3


def test_bad_inputs_raise() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v, out = fused_rows(8, 4, 2, 16, gen)
    starts, lens = starts_of([3, 5]), torch.tensor([3, 5])
    with pytest.raises(ValueError, match="3-D"):
        flash_attention_varlen(q[None], k, v, out, starts, lens, 5)
    with pytest.raises(ValueError, match="4-D"):
        flash_attention_varlen(q, k, v, out, starts, lens, 5, paged=True)
    with pytest.raises(ValueError, match="out must match q"):
        flash_attention_varlen(q, k, v, out[:4], starts, lens, 5)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention_varlen(q[:, :3], k, v, out[:, :3], starts, lens, 5)
    with pytest.raises(ValueError, match=r"\(B\+1,\)"):
        flash_attention_varlen(q, k, v, out, starts[:2], lens, 5)
    with pytest.raises(ValueError, match="block_tables"):
        flash_attention_varlen(q, k, v, out, starts, lens, 5, block_tables=lens[:, None])
    with pytest.raises(ValueError, match="scale must be positive"):
        flash_attention_varlen(q, k, v, out, starts, lens, 5, scale=-1.0, impl="triton")


# --- GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_many_short_prompts_match_per_sequence_kernel() -> None:
    """256 prompts of 128 tokens (the engine's big prefill), bf16: the same numbers as
    flash_attention_tokens sequence by sequence, and close to the fp32 reference."""
    from layer1_kernels.flash_attention import flash_attention_tokens
    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = [128] * 200 + [1, 77, 300, 5] * 14
    T, hq, hkv, d = sum(lens), 32, 8, 64
    rows = torch.randn(T, (hq + 2 * hkv) * d, generator=gen, device="cuda").bfloat16()
    q = rows[:, :hq * d].view(T, hq, d)
    k = rows[:, hq * d:(hq + hkv) * d].view(T, hkv, d)
    v = rows[:, (hq + hkv) * d:].view(T, hkv, d)
    starts = starts_of(lens).cuda()
    out = flash_attention_varlen(q, k, v, torch.empty_like(q), starts, torch.tensor(lens).cuda(),
                                 max(lens))
    ref = torch.empty_like(q)
    s = starts.tolist()
    for b in range(len(lens)):
        r = slice(s[b], s[b + 1])
        flash_attention_tokens(q[r], k[r], v[r], ref[r])
    assert rel_err(out, ref) < 1e-2
    exact = flash_attention_varlen(q.float(), k.float(), v.float(), torch.empty_like(q).float(),
                                   starts, torch.tensor(lens).cuda(), max(lens), impl="torch")
    assert rel_err(out, exact) < 1e-2


COMPILE = r'''
import os
os.environ["TRITON_INTERPRET"] = "0"
import importlib
from tests.layer1.sm90 import compile_for_sm90
V = importlib.import_module("layer1_kernels.flash_attention_varlen")
ptrs = {"q_start_ptr": "*i64", "seq_lens_ptr": "*i64", "tables_ptr": "*i64"}
for paged, identity, page, bm, warps in [(False, False, 1, 64, 4), (True, False, 16, 128, 8),
                                         (True, True, 1, 64, 4)]:
    consts = dict(HEAD_DIM=128, BLOCK_M=bm, BLOCK_N=64, PAGE=page, PAGED=paged,
                  IDENTITY=identity, PRECISION="tf32")
    compile_for_sm90(V._flash_varlen_kernel, consts, ptrs, {"num_warps": warps, "num_stages": 3})
print("compiled")
'''


def test_compiles_for_sm90() -> None:
    """The interpreter runs kernel code as Python and accepts what the compiler rejects: the
    real compiler builds the kernel for cuda:90 in all three key layouts (ptxas ships with
    Triton; no GPU needed)."""
    from .sm90 import run_compile_script
    run = run_compile_script(COMPILE, "compiling the varlen attention kernel")
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]
