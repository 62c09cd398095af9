"""layer1_kernels.paged_decode against a float64 attention computed one sequence at a time:
the interpreter on a CPU, the compiled kernel on a GPU (pytest -m gpu), and an ahead-of-time
compile for sm_90 (the interpreter accepts code the compiler rejects).

Awkward sizes throughout: odd batches, GQA groups 1, 3, 4 and 5, lengths that are not
multiples of a page or of BLOCK_N, more parts than a sequence has keys, split counts past
one merge tile (MERGE_S parts a round trip), sliding windows, NaN in every slot a query
must not read."""
from __future__ import annotations

import importlib

import pytest
import torch

from layer1_kernels import interpreter

from ..paged_case import make_case
from .sm90 import run_compile_script

pd = importlib.import_module("layer1_kernels.paged_decode")  # the package's name is the function

DEV = "cpu" if interpreter.INTERPRETED else "cuda"


def make(lens, hq, hkv, d, page, *, dtype=torch.float32, seed=0, window=None):
    """make_case's paged cache (shuffled blocks, NaN outside the visible keys) as the tuple
    the kernel takes: q, k, v, int32 block tables, int64 lengths."""
    c = make_case(lens, hq, hkv, d, page, window=window, dtype=dtype, device=DEV, seed=seed,
                  table_dtype=torch.int32)
    return c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["seq_lens"].long()


def reference(q, k, v, tables, lens, scale, window):
    q, k, v, tables = q.double().cpu(), k.double().cpu(), v.double().cpu(), tables.cpu().long()
    B, Hq, D = q.shape
    page, group = k.shape[1], Hq // k.shape[2]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        j = torch.arange(0 if window is None else max(0, n - window), n)
        if len(j) == 0:
            continue
        kk, vv = k[tables[b, j // page], j % page], v[tables[b, j // page], j % page]
        for h in range(Hq):
            out[b, h] = torch.softmax(kk[:, h // group] @ q[b, h] * scale, 0) @ vv[:, h // group]
    return out


def rel(a, ref):
    return ((a.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


CASES = [  # lens, hq, hkv, d, page, window
    ([37, 1, 22], 4, 4, 16, 8, None),           # MHA, a 1-token sequence
    ([50, 17, 33, 9, 64], 12, 4, 32, 16, None),  # group 3, B = 5
    ([70, 33], 10, 2, 16, 32, 9),                # group 5, window shorter than a page
    ([45, 12, 29], 8, 2, 64, 8, 20),             # window across pages
]


@pytest.mark.interpreter
@pytest.mark.parametrize("lens,hq,hkv,d,page,window", CASES)
@pytest.mark.parametrize("splits,fused,heads_first", [(1, True, False), (3, True, True),
                                                      (4, False, False), (7, True, False)])
def test_matches_float64(lens, hq, hkv, d, page, window, splits, fused, heads_first):
    q, k, v, t, n = make(lens, hq, hkv, d, page, seed=len(lens) + splits, window=window)
    ref = reference(q, k, v, t, n, 0.3, window)
    for _ in range(2):  # twice: the merge counters must be back at zero after a call
        out = pd.paged_decode(q, k, v, t, n, 0.3, window, splits, fused_merge=fused,
                              heads_first=heads_first)
        assert out.shape == q.shape and torch.isfinite(out).all()
        assert rel(out, ref) < 1e-5


@pytest.mark.interpreter
def test_more_parts_than_one_merge_tile_and_than_keys():
    """100 parts: past one (MERGE_G, MERGE_S, D) merge tile, and most parts of the short
    sequences are empty (lse -inf): they drop out; an empty sequence gives 0. The fused merge
    cuts 300 keys into the same 19 parts of 16 from any count of 19 or more, the programs
    past them returning at once: 24 does 100's work with 608 fewer programs for the
    interpreter to run; the merge kernel (unfused) reads all 100."""
    q, k, v, t, n = make([300, 5, 0, 77], 8, 2, 64, 4, seed=3)
    assert pd._tiles(4, 64, 100)[2] < 100
    ref = reference(q, k, v, t, n, 0.25, None)
    for fused, merge_s, splits in [(True, None, 24), (False, None, 100), (True, 4, 24),
                                   (True, 32, 24)]:
        out = pd.paged_decode(q, k, v, t, n, 0.25, None, splits, fused_merge=fused,
                              config={"merge_s": merge_s})
        assert torch.isfinite(out).all() and (out[2] == 0).all()
        assert rel(out, ref) < 1e-5


def test_merge_tile_and_the_split_rule_keep_one_wave():
    """The merge reads 16 parts a round trip up to 16 parts, 32 beyond (a config may ask for
    fewer); 32 cost the D-64 kernel 153 registers a thread on sm_90 (3 programs an SM, not
    4), so a 32-part split count aims at 3 programs an SM: batch 1 x 8 kv heads gets 32
    parts (256 programs), not 64."""
    assert pd._tiles(4, 64, 64) == pd._tiles(4, 64, 32) == (16, 4, 32)
    assert pd._tiles(4, 64, 16) == (16, 4, 16) and pd._tiles(4, 64, 64, 16)[2] == 16
    assert pd._tiles(4, 64, 2) == (16, 4, 16) and pd._tiles(4, 64, 2, 4)[2] == 4
    assert pd._tiles(4, 128, 64, 64)[2] == 16  # within 8192 floats
    assert pd.paged_decode_splits(1, 8, 16384, 132) == 32
    assert pd.paged_decode_splits(1, 8, 8192, 132, head_dim=128) == 64  # D 128: 16-part tile


def test_d128_config_follows_the_part_length(monkeypatch):
    """D 128 takes the latency-bound config (64 keys a step, no pipelining) for short parts
    only: batch 32 cut in two long parts keeps the bandwidth-bound unsplit config."""
    monkeypatch.setattr(pd.interpreter, "INTERPRETED", False)  # the GPU's configs
    bf16 = torch.bfloat16
    assert pd.default_config(128, bf16, 64, 8192)["BLOCK_N"] == 64  # parts of 128 keys
    # ... with the block ids fetched a step ahead (the first before the PDL wait): a config
    # without the key would take PIPELINED_IDS' setting, on for D 64's long parts
    assert pd.default_config(128, bf16, 64, 8192)["pipelined_ids"] is False
    assert pd.default_config(128, bf16, 2)["BLOCK_N"] == 64  # length unknown: split = short
    long = pd.default_config(128, bf16, 2, 4096)  # parts of 2048 keys
    assert (long["BLOCK_N"], long["num_warps"]) == (128, 8) == tuple(
        pd.default_config(128, bf16, 1, 4096)[k] for k in ("BLOCK_N", "num_warps"))
    # D 64 unsplit with few programs (batch 32's regime): 3 stages; else 2
    assert pd.default_config(64, bf16, 1, 1024, few_programs=True)["num_stages"] == 3
    assert pd.default_config(64, bf16, 1, 1024)["num_stages"] == 2
    assert pd.default_config(64, bf16, 2, 1024, few_programs=True)["num_stages"] == 2


def test_pipelined_ids_only_for_long_parts_in_one_wave(monkeypatch):
    """By default each step's block ids go through the software pipeline (5 stages: 3 programs
    an SM) only where the launch fits in one wave at that occupancy and the parts are 512 keys
    or more: batch 32 unsplit, and batch 1 x 16k in 32 parts (2 programs an SM with parts of
    four steps: 7 stages), not 1 x 4k's one-step parts nor a launch that needs 4 programs an
    SM; never with the knob off, for a launch not counted (a contiguous cache), nor at D 128."""
    monkeypatch.setattr(pd.interpreter, "INTERPRETED", False)  # the GPU's configs
    monkeypatch.setattr(pd, "PIPELINED_IDS", {"on": True})
    bf16 = torch.bfloat16
    one = pd.default_config(64, bf16, 32, 16384, per_sm=256 / 132)  # batch 1 x 16k
    assert one["pipelined_ids"] and one["num_stages"] == pd.PIPELINED_SHORT_STAGES == 7
    b32 = pd.default_config(64, bf16, 1, 1024, few_programs=True, per_sm=256 / 132)
    assert b32["pipelined_ids"] and b32["num_stages"] == pd.PIPELINED_STAGES == 5
    assert pd.default_config(64, bf16, 32, 16384, per_sm=2.5)["num_stages"] == 5
    for cfg in (pd.default_config(64, bf16, 32, 4096, per_sm=1.9),  # parts of 128 keys
                pd.default_config(64, bf16, 16, 16384, per_sm=3.9),  # 1.3 waves at 3 an SM
                pd.default_config(64, bf16, 16, 16384),               # not counted
                pd.default_config(64, bf16, 32, None, per_sm=1.9),   # length unknown
                pd.default_config(128, bf16, 32, 16384, per_sm=1.9)):
        assert not cfg.get("pipelined_ids") and cfg["num_stages"] < 5
    monkeypatch.setattr(pd, "PIPELINED_IDS", {"on": False})
    assert not pd.default_config(64, bf16, 32, 16384, per_sm=1.9).get("pipelined_ids")


@pytest.mark.interpreter
def test_per_sm_counts_the_programs_of_paged_launches_only(monkeypatch):
    """paged_decode gives default_config a paged launch's programs an SM (for the pipelined
    ids' occupancy rule), and nothing for a contiguous cache (no ids: it keeps its config)."""
    seen = []
    real = pd.default_config

    def spy(*args):
        seen.append(args[-1])
        return real(*args)
    monkeypatch.setattr(pd, "default_config", spy)
    monkeypatch.setattr(pd, "PIPELINED_IDS", {"on": True})
    q, k, v, t, n = make([40, 9], 4, 2, 16, 8, seed=5)  # 2 x 2 kv heads x 3 parts: 12 programs
    for sms in (4, 3):
        monkeypatch.setattr(pd, "_sms", lambda dev, sms=sms: sms)
        pd.paged_decode(q, k, v, t, n, 0.25, None, 3)
        assert seen[-1] == 12 / sms
    kc = torch.randn(2, 40, 2, 16)  # a contiguous cache: (batch, max_len, kv heads, D)
    pd.paged_decode(q, kc, kc, None, n, 0.25, None, 3)
    assert seen[-1] is None


@pytest.mark.interpreter
# (40, 16): min_part decides every part (16 splits cut the parts 40 keys long, as 64 would)
@pytest.mark.parametrize("min_part,splits", [(1, 9), (16, 8), (24, 5), (40, 16)])
def test_parts_follow_each_sequence_length(min_part, splits):
    """The fused kernel cuts each sequence into as many parts as its keys fill (none under
    min_part keys, at most the launch's split count; a part not a multiple of BLOCK_N too):
    a short one runs as one part (no partials, no merge), a long one's empty parts do
    nothing. Lengths across a page, one key, none; with and without the early index loads,
    and with the first tile peeled off the loop; the first twice (the counters back at
    zero)."""
    q, k, v, t, n = make([200, 1, 0, 33, 17, 64], 8, 2, 32, 16, seed=min_part)
    ref = reference(q, k, v, t, n, 0.2, None)
    cfg = dict(pd.default_config(32, q.dtype, splits), min_part=min_part)
    for early, peel, times in ((True, False, 2), (False, False, 1), (False, True, 1)):
        for _ in range(times):
            out = pd.paged_decode(q, k, v, t, n, 0.2, None, splits,
                                  config=dict(cfg, early_index=early, peel=peel))
            assert torch.isfinite(out).all() and (out[2] == 0).all()
            assert rel(out, ref) < 1e-5
    assert int(pd._COUNTERS[q.device].abs().sum()) == 0


@pytest.mark.interpreter
@pytest.mark.parametrize("lens,hq,hkv,d,page,window,heads", [
    ([50, 17, 33, 9, 64], 12, 4, 32, 16, None, 2),  # group 3: 6 rows a program
    ([70, 0, 33], 10, 2, 16, 32, 9, 2),              # group 5, a window, an empty sequence
    ([40, 1, 19], 9, 3, 16, 8, None, 4),             # 3 kv heads in a program of 4 (one masked)
    ([45, 12, 29], 8, 8, 64, 8, 20, 8)])             # MHA, a token's 8 heads in one run
def test_packed_kv_heads_match_float64(lens, hq, hkv, d, page, window, heads):
    """Several kv heads a program (config "heads"): each query row scores only its own kv
    head's columns of the packed tile; split, merged in the launch or by the merge kernel,
    both grid orders, twice (the counters, one per program, back at zero)."""
    q, k, v, t, n = make(lens, hq, hkv, d, page, seed=heads, window=window)
    ref = reference(q, k, v, t, n, 0.3, window)
    for splits, fused, hf in [(1, True, True), (3, True, False), (4, False, True)]:
        for _ in range(2):
            out = pd.paged_decode(q, k, v, t, n, 0.3, window, splits, fused_merge=fused,
                                  heads_first=hf, config={"heads": heads})
            assert torch.isfinite(out).all() and rel(out, ref) < 1e-5, (splits, fused, hf)
    assert int(pd._COUNTERS[q.device].abs().sum()) == 0


@pytest.mark.interpreter
@pytest.mark.parametrize("lens,hq,hkv,d,page,window,heads", [
    ([133, 1, 77, 0, 90], 4, 4, 64, 16, None, 1),   # MHA (group 1), odd lengths, an empty one
    ([261, 45, 129], 16, 4, 128, 4, None, 1),       # group 4, D 128, tables 66 blocks wide
    ([201, 3, 96], 10, 2, 64, 32, 70, 1),           # group 5, a window across pages
    ([150, 17, 61], 8, 2, 64, 16, None, 2)])        # kv heads packed two a program
def test_pipelined_ids_match_float64(lens, hq, hkv, d, page, window, heads):
    """Each loop step loading its own tile's block ids (config "pipelined_ids", for the
    compiler's software pipeline) computes the same attention: split in the launch and by
    the merge kernel, one part and many (more than some sequences fill), the first tile
    peeled or not; a launch that merges parts twice (the counters back at zero)."""
    q, k, v, t, n = make(lens, hq, hkv, d, page, seed=hq + d, window=window)
    ref = reference(q, k, v, t, n, 0.2, window)
    for splits, fused, extra, times in [(1, True, {}, 1), (5, True, {}, 2), (6, False, {}, 1),
                                        (9, True, {"peel": True}, 1),
                                        (3, False, {"peel": True}, 1)]:
        cfg = {"pipelined_ids": True, "heads": heads, "min_part": 16, **extra}
        for _ in range(times):
            out = pd.paged_decode(q, k, v, t, n, 0.2, window, splits, fused_merge=fused,
                                  config=cfg)
            assert torch.isfinite(out).all() and rel(out, ref) < 1e-5, (splits, fused, extra)
    assert int(pd._COUNTERS[q.device].abs().sum()) == 0


@pytest.mark.interpreter
def test_packing_by_default_follows_the_split_rule(monkeypatch):
    """With PACK_HEADS set, a call without a config packs that many kv heads a program where
    the batch gives PACK_FROM programs an SM, and the split count counts packed programs;
    the result is the same attention."""
    assert pd.paged_decode_splits(32, 8, 4096, 132, heads=4) == 8  # 64 programs: 8 parts
    assert pd.default_heads(32, 8, 64, 132) == 1  # off by default
    monkeypatch.setattr(pd, "PACK_HEADS", 4)
    monkeypatch.setattr(pd, "PACK_FROM", 1.5)
    assert pd.default_heads(32, 8, 64, 132) == 4 and pd.default_heads(32, 8, 128, 132) == 1
    assert pd.default_heads(16, 8, 64, 132) == 1  # 0.97 programs an SM: not packed
    assert pd.paged_decode_splits(32, 8, 4096, 132, head_dim=64) == 8
    q, k, v, t, n = make([90, 3, 40], 8, 4, 16, 8, seed=7)  # on "one SM": packed
    assert pd.default_heads(3, 4, 16, 1) == 4
    ref = reference(q, k, v, t, n, 0.3, None)
    for _ in range(2):
        assert rel(pd.paged_decode(q, k, v, t, n, 0.3, None), ref) < 1e-5
    assert pd.default_config(16, q.dtype, 2, 128, heads=4)["heads"] == 4


def contiguous(lens, hq, hkv, d, capacity, seed):
    """Layer 3's contiguous cache, (batch, capacity, kv heads, D) read in place (no tables:
    sequence b is block b), NaN past each length; with the same cache as a paged one (one
    block a sequence) for the reference."""
    g = torch.Generator().manual_seed(seed)
    k = torch.full((len(lens), capacity, hkv, d), float("nan"))
    v = torch.full_like(k, float("nan"))
    for b, n in enumerate(lens):
        k[b, :n], v[b, :n] = torch.randn(2, n, hkv, d, generator=g)
    q = torch.randn(len(lens), hq, d, generator=g)
    tables = torch.arange(len(lens))[:, None]
    return q, k, v, tables, torch.tensor(lens)


WIDE_CASES = [  # lens, hq, hkv, d, capacity (contiguous) / page (paged)
    ([1, 63, 65, 257, 0], 8, 2, 64, 300),     # GQA 4 (the 1B group), D 64
    ([129, 1, 64, 200], 16, 2, 128, 260),     # GQA 8, D 128
    ([513, 7, 256], 4, 1, 64, 520),           # GQA 4, more than one tile: parts merged
]


@pytest.mark.interpreter
@pytest.mark.parametrize("lens,hq,hkv,d,cap", WIDE_CASES)
@pytest.mark.parametrize("keys,stages", [(64, 1), (256, 2)])
def test_wide_tiles_match_float64(lens, hq, hkv, d, cap, keys, stages):
    """Wide tiles (benchmarks/decode_attention_tiles.py's launches: one loop step of `keys`
    keys a part, parts of at least that many): a context of at most one tile is one part, a
    longer one parts of a tile merged in the launch; awkward lengths (1, 63, 65, 257, empty),
    GQA 4 and 8, D 64 and 128, the contiguous cache (no tables) and a paged one, split
    counts from 1 to more parts than any context fills (16: at most 9 parts fill, cut as 64
    would cut them, with fewer idle programs for the interpreter), the first tile peeled and
    not; the counters back at zero after."""
    q, k, v, t, n = contiguous(lens, hq, hkv, d, cap, seed=keys + d)
    ref = reference(q, k, v, t, n, 0.2, None)
    pq, pk, pv, pt, pn = make(lens, hq, hkv, d, 16, seed=keys + d + 1)
    pref = reference(pq, pk, pv, pt, pn, 0.2, None)
    cfg = {"BLOCK_N": keys, "num_warps": 8, "num_stages": stages, "min_part": keys}
    for splits, extra in ((1, {}), (16, {}), (16, {"peel": True}), (3, {"peel": True})):
        out = pd.paged_decode(q, k, v, None, n, 0.2, None, splits, config={**cfg, **extra})
        assert torch.isfinite(out).all() and rel(out, ref) < 1e-5, (splits, extra)
        assert (out[n == 0] == 0).all()
        out = pd.paged_decode(pq, pk, pv, pt, pn, 0.2, None, splits, config={**cfg, **extra})
        assert torch.isfinite(out).all() and rel(out, pref) < 1e-5, (splits, extra)
    assert int(pd._COUNTERS[q.device].abs().sum()) == 0


@pytest.mark.interpreter
def test_buffers_are_kept_and_grow():
    """The partial-result buffers are reused across calls and replaced (the old ones kept
    alive for captured graphs) when a call needs more."""
    q, k, v, t, n = make([40, 9], 4, 2, 16, 8, seed=4)
    pd.paged_decode(q, k, v, t, n, 0.25, None, 2)
    kept = pd._PARTS[q.device]
    pd.paged_decode(q, k, v, t, n, 0.25, None, 3)
    assert pd._PARTS[q.device] is kept
    big = pd._parts(q.device, kept[1].numel() + 1, 16)
    assert big[1].numel() > kept[1].numel() and any(r is kept[0] for r in pd._RETIRED)
    out = pd.paged_decode(q, k, v, t, n, 0.25, None, 3)
    assert rel(out, reference(q, k, v, t, n, 0.25, None)) < 1e-5


COMPILE = r'''
import os
os.environ["TRITON_INTERPRET"] = "0"
import importlib
from tests.layer1.sm90 import compile_for_sm90
P = importlib.import_module("layer1_kernels.paged_decode")
ptrs = {"tables_ptr": "*i32", "seq_lens_ptr": "*i64", "part_o_ptr": "*fp32",
        "part_lse_ptr": "*fp32", "count_ptr": "*i32"}
for ident, fused, hf, bn, warps, stages, early, heads in [
        (True, True, False, 64, 4, 2, True, 1), (False, True, True, 128, 4, 2, False, 1),
        (False, True, True, 32, 4, 2, True, 1), (False, False, False, 256, 8, 3, False, 1),
        (False, True, True, 32, 4, 2, True, 4), (True, True, True, 64, 4, 2, False, 2)]:
    consts = dict(HEAD_DIM=64, PAGE=385 if ident else 16, BLOCK_G=max(16, 4 * heads),
                  BLOCK_N=bn, WINDOWED=True, IDENTITY=ident, FUSED_MERGE=fused, PDL=True,
                  MERGE_G=4 * heads, MERGE_S=16 // heads, HEADS_FIRST=hf, EARLY_INDEX=early,
                  HEADS=heads, PEEL=heads == 1 and bn in (32, 128), TRIGGER_EARLY=early,
                  PIPELINED_IDS=not ident and bn == 32)
    compile_for_sm90(P._paged_decode_kernel, consts, ptrs,
                     {"num_warps": warps, "num_stages": stages, "launch_pdl": True})
for d, (bn, warps, stages) in ((64, (256, 8, 2)), (128, (128, 8, 2))):  # one-step wide tiles
    for ident in (True, False):
        consts = dict(HEAD_DIM=d, PAGE=2112 if ident else 16, BLOCK_G=16, BLOCK_N=bn,
                      WINDOWED=False, IDENTITY=ident, FUSED_MERGE=True, PDL=True, MERGE_G=4,
                      MERGE_S=16, HEADS_FIRST=True, EARLY_INDEX=True, HEADS=1, PEEL=ident,
                      TRIGGER_EARLY=ident, PIPELINED_IDS=False)
        k = compile_for_sm90(P._paged_decode_kernel, consts, ptrs,
                             {"num_warps": warps, "num_stages": stages, "launch_pdl": True},
                             aligned=True)
        assert k.metadata.shared <= 227 * 1024, (d, bn, k.metadata.shared)
print("compiled")
'''


def test_compiles_for_sm90():
    run = run_compile_script(COMPILE, "compiling the paged decode kernel")
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


SCHEDULE = r'''
import os
os.environ["TRITON_INTERPRET"] = "0"
import importlib, json, re
from tests.layer1.sm90 import compile_for_sm90
P = importlib.import_module("layer1_kernels.paged_decode")
ptrs = {"tables_ptr": "*i32", "seq_lens_ptr": "*i64", "part_o_ptr": "*fp32",
        "part_lse_ptr": "*fp32", "count_ptr": "*i32"}
unit = dict(stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1, stride_tc=1)  # as the JIT sees
found = {}
for pipelined, stages in [(False, 3), (True, 5)]:
    consts = dict(HEAD_DIM=64, PAGE=16, BLOCK_G=16, BLOCK_N=128, WINDOWED=False, IDENTITY=False,
                  FUSED_MERGE=True, PDL=True, MERGE_G=4, MERGE_S=32, HEADS_FIRST=True,
                  EARLY_INDEX=True, HEADS=1, PEEL=False, TRIGGER_EARLY=False,
                  PIPELINED_IDS=pipelined, **unit)
    k = compile_for_sm90(P._paged_decode_kernel, consts, ptrs,
                         {"num_warps": 4, "num_stages": stages, "launch_pdl": True}, aligned=True)
    loop = k.asm["ttgir"].split("scf.for", 1)[1].split("scf.yield", 1)[0]  # the key loop
    found[str(pipelined)] = dict(
        table_loads=len(re.findall(r"tt.load [^\n]*!tt.ptr<i32>", loop)),
        table_copies=len(re.findall(r"async_copy_global_to_local [^\n]*!tt.ptr<i32>", loop)),
        kv_copies=len(re.findall(r"async_copy_global_to_local [^\n]*!tt.ptr<bf16>", loop)),
        waits=[int(w) for w in re.findall(r"async_wait[^\n]*num = (\d+)", loop)])
print("JSON", json.dumps(found))
'''


def test_pipelined_ids_let_the_compiler_fetch_them_ahead():
    """Why "pipelined_ids" exists, read off the compiler's schedule for sm_90 (the 1 x 16k
    shape's loop: 128 keys, 4 warps): with the next tile's ids fetched a step ahead in
    registers, the pipeline copies keys and values ahead (cp.async) but loads the ids with a
    plain load inside the loop, right before the copies that need them (a round trip every
    step); with each step's own ids at 5 stages, the ids are copied ahead too and each step
    waits only for its own tile (copies still in flight: wait count > 0)."""
    import json
    run = run_compile_script(SCHEDULE, "compiling the paged decode loop")
    assert run.returncode == 0 and "JSON" in run.stdout, run.stderr[-3000:]
    found = json.loads(run.stdout.split("JSON ", 1)[1])
    ahead, pipelined = found["False"], found["True"]
    assert ahead["table_loads"] == 1 and ahead["table_copies"] == 0 and ahead["kv_copies"] == 2
    assert pipelined["table_loads"] == 0 and pipelined["table_copies"] == 1
    assert pipelined["kv_copies"] == 2 and min(pipelined["waits"]) > 0


# ---- GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,config,orders", [
    (torch.bfloat16, None, (True, False)), (torch.float16, None, (True,)),
    (torch.bfloat16, {"BLOCK_N": 256, "num_warps": 8, "num_stages": 2}, (True,)),
    (torch.bfloat16, {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "heads": 4, "merge_s": 4},
     (True, False)),
    (torch.bfloat16, {"BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "heads": 8}, (True,)),
    (torch.bfloat16, {"BLOCK_N": 128, "num_warps": 4, "num_stages": 5, "pipelined_ids": True},
     (True, False)),
    (torch.bfloat16, {"BLOCK_N": 64, "num_warps": 4, "num_stages": 7, "pipelined_ids": True},
     (True,)),
    (torch.bfloat16, {"BLOCK_N": 128, "num_warps": 4, "num_stages": 7, "pipelined_ids": True},
     (True,)),
    (torch.float16, {"BLOCK_N": 32, "num_warps": 4, "num_stages": 5, "heads": 4, "merge_s": 4,
                     "pipelined_ids": True}, (True,))],
    ids=["default-bf16", "default-fp16", "256-keys", "heads4", "heads8", "pipelined-128",
         "pipelined-64-7stages", "pipelined-128-7stages", "pipelined-heads4"])
def test_gpu_configs_and_direct_launch(dtype, config, orders):
    """The configs the heuristics pick (and others: kv heads packed 4 and 8 a program; each
    step's block ids in the software pipeline, 5 and 7 stages),
    JIT-launched and then directly launched (the second call of a shape), against float64,
    at 1 and many parts (one and several merge tiles), both grid orders."""
    lens = [1000, 3, 517, 129, 2048, 64, 700]
    q, k, v, t, n = make(lens, 32, 8, 64, 16, dtype=dtype, seed=11)
    ref = reference(q, k, v, t, n, 0.125, None)
    for splits in (1, 5, 33):
        for hf in orders:
            outs = [pd.paged_decode(q, k, v, t, n, 0.125, None, splits, config=config,
                                    heads_first=hf) for _ in range(3)]
            for out in outs:
                assert torch.isfinite(out).all() and rel(out, ref) < 1e-2
            assert torch.equal(outs[0], outs[2])  # the direct launch computes what the JIT did


@pytest.mark.gpu
def test_gpu_misaligned_q_takes_the_jit_and_stays_right():
    lens = [300, 45]
    q, k, v, t, n = make(lens, 8, 2, 64, 16, dtype=torch.bfloat16, seed=2)
    wide = torch.zeros(2, 8 * 64 + 1, dtype=q.dtype, device=q.device)
    wide[:, 1:] = q.reshape(2, -1)
    qm = wide[:, 1:].view(2, 8, 64)  # 2 bytes past a 16-byte boundary
    ref = reference(q, k, v, t, n, 0.125, None)
    for _ in range(2):
        assert rel(pd.paged_decode(qm, k, v, t, n, 0.125, None, 3), ref) < 1e-2
        assert rel(pd.paged_decode(q, k, v, t, n, 0.125, None, 3), ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (8, 2, 128), (32, 8, 64)])
@pytest.mark.parametrize("pipelined", [False, True], ids=["ids-ahead", "pipelined"])
def test_gpu_graph_replays_follow_the_lengths(hq, hkv, d, pipelined):
    """The engine's use: one launch captured in a CUDA graph (block tables as wide as a long
    max_model_len, so the split count is the largest the rule gives), replayed while the
    lengths change: each replay cuts each sequence by its own length (one part, a few, many),
    the counters stay consistent across replays, early index loads (and the early trigger of
    the next kernel) on and off, each step's block ids in the software pipeline or not."""
    g = torch.Generator(device=DEV).manual_seed(d + hkv)
    B, width = 4, 256  # 4096 keys a sequence at most
    k = torch.randn(B * width + 1, 16, hkv, d, generator=g, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    t = torch.randperm(B * width, generator=g, device=DEV).view(B, width)
    q = torch.randn(B, hq, d, generator=g, device=DEV, dtype=torch.bfloat16)
    splits = pd.paged_decode_splits(B, hkv, width * 16, 132)
    steps = ([4000, 1, 130, 17], [3000, 16, 129, 1], [33, 2000, 1, 256], [4096, 4096, 0, 64])
    for early in (True, False):
        cfg = dict(pd.default_config(d, q.dtype, splits), early_index=early, trigger_early=early)
        if pipelined:  # each step's block ids in the software pipeline
            cfg.update(pipelined_ids=True, num_stages=pd.PIPELINED_STAGES)
        lens = torch.tensor(steps[0], device=DEV)

        def fn(lens=lens, cfg=cfg):
            return pd.paged_decode(q, k, v, t, lens, 0.1, None, splits, config=cfg)
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        for step in steps:
            lens.copy_(torch.tensor(step, device=DEV))
            graph.replay()
            torch.cuda.synchronize()
            assert rel(out, reference(q, k, v, t, lens, 0.1, None)) < 1e-2, (step, early,
                                                                              pipelined)
        assert (out[2] == 0).all()  # the last step's empty sequence
