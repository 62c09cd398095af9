"""Paged decode attention against SDPA on contiguous K/V (GPU): is reading through block
tables free? The target: paged decode at >= 0.9x the speed of contiguous SDPA decode at equal
context, and as close to layer 0's copy bandwidth as SDPA gets.

    python -c "from layer4_algorithms.bench.paged_attention import bench_paged_decode as b; b()"
"""
from __future__ import annotations

import math

import torch

import layer3_model as l3

# isort: split
import triton

from ..kv.paged_attention import decode_bytes_and_flops, paged_decode_attention, pick_num_splits

_DEVICE = "cuda"  # a CPU smoke test of this file's code swaps it (and the timer) out
GRAPH_SKIPPED = "CUDA-graph replay timing needs a CUDA device: skipped"


def graph_replay_us(fn, *, calls: int = 20, replays: int = 10) -> float:
    """Microseconds per call of `fn` under CUDA-graph replay (layer 3's graph_replay_us:
    `calls` calls in one graph, after an untimed warm-up). The kernels and their launch gaps
    on the GPU -- the cost the engine pays, where decode runs from a captured graph -- not
    the Python wrapper's argument checks that do_bench also times at small shapes."""
    return l3.graph_replay_us(fn, calls=calls, replays=replays, warmup=3)


def _time_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               do_bench) -> tuple[float, str, torch.Tensor, object]:
    """The fastest way SDPA does this GQA decode: (median ms, its name, its (B, Hq, D) output,
    a no-argument call of it under its backend, for graph capture).
    Two layouts -- q (B, Hq, 1, D) with enable_gqa, and "rows": the G query heads of a kv head
    as G query rows, q viewed (B, Hkv, G, D) (layer 3's decode path) -- times each backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, Hq, D = q.shape
    Hkv = k.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    layouts = {
        "gqa": lambda: sdpa(q[:, :, None], k, v, scale=scale, enable_gqa=True).view(B, Hq, D),
        "rows": lambda: sdpa(q.view(B, Hkv, Hq // Hkv, D), k, v, scale=scale).view(B, Hq, D),
    }
    best: tuple | None = None
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION):
        for layout, fn in layouts.items():
            try:
                with sdpa_kernel(backend):
                    out = fn()
                    ms = do_bench(fn, return_mode="median")
            except RuntimeError:  # this backend does not take these inputs
                continue
            if best is None or ms < best[0]:
                name = f"{backend.name.lower().removesuffix('_attention')}/{layout}"
                best = (ms, name, out, _under(backend, fn))
    if best is None:  # no fused backend takes them: PyTorch's own choice
        best = (do_bench(layouts["rows"], return_mode="median"), "default/rows", layouts["rows"](),
                layouts["rows"])
    return best


def _under(backend, fn):
    """fn, called under SDPA backend `backend` (so a captured graph records that backend)."""
    from torch.nn.attention import sdpa_kernel

    def call():
        with sdpa_kernel(backend):
            return fn()
    return call


def _case(B: int, N: int, Hq: int, Hkv: int, D: int, block_size: int, dtype: torch.dtype,
          gen: torch.Generator) -> dict:
    """Random inputs: a paged cache with each sequence's blocks shuffled across it, and the
    same keys and values as contiguous (B, Hkv, N, D) tensors for SDPA."""
    dev = torch.device(_DEVICE)
    per_seq = triton.cdiv(N, block_size)
    shape = (B * per_seq, block_size, Hkv, D)
    k_cache = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
    tables = torch.randperm(B * per_seq, generator=gen, device=dev).view(B, per_seq).to(torch.int32)
    gathered = [c[tables.long()].reshape(B, -1, Hkv, D)[:, :N].transpose(1, 2).contiguous()
                for c in (k_cache, v_cache)]
    return dict(q=torch.randn((B, Hq, D), generator=gen, device=dev, dtype=dtype),
                k_cache=k_cache, v_cache=v_cache, tables=tables,
                seq_lens=torch.full((B,), N, dtype=torch.int32,
                                    device=dev), k=gathered[0], v=gathered[1])


@torch.no_grad()
def bench_paged_decode(batches=(1, 4, 8, 32), contexts=(1024, 4096, 16384), *, q_heads: int = 32,
                       kv_heads: int = 8, head_dim: int = 64, block_size: int = 16,
                       dtype: torch.dtype = torch.bfloat16, splits=(None,),
                       verbose: bool = True, graph_replay: bool = True) -> list[dict]:
    """Time paged_decode_attention against torch's scaled_dot_product_attention on contiguous
    K/V of the same context (every sequence at `context` tokens; heads as Llama-3.2-1B by
    default: 32 query heads, 8 kv heads, D 64), random data, blocks shuffled across the cache.
    Timed with triton.testing.do_bench (median, L2 flushed between calls); SDPA is the fastest
    of its flash / cuDNN / efficient backends and two GQA layouts (see _time_sdpa).

    One dict per (batch, context, split setting): ours_us, sdpa_us, speedup (sdpa / ours;
    target >= 0.9), gbps (from the fewest bytes: q, K, V, out), of_copy (fraction of layer 0's
    measured copy bandwidth), max_abs_diff from SDPA's output. splits: num_splits values to
    try (None: pick_num_splits), e.g. (None, 1, 2, 4, 8, 16, 32) to tune it. graph_replay:
    also time both sides under CUDA-graph replay (graph_replay_us: ours_graph_us,
    sdpa_graph_us, graph_speedup), the fair comparison at small shapes (no L2 flush there:
    small caches stay in L2 for both sides alike). Needs CUDA; a CPU smoke test swaps
    _DEVICE, and the graph columns then say why they are empty."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_paged_decode times the GPU kernel and needs a CUDA GPU; "
                           "torch.cuda.is_available() is False here")
    from triton.testing import do_bench

    try:
        copy_bw = l3.load_ceilings(_DEVICE).memory_bandwidth  # bytes/s, measured by layer 0
    except (OSError, ValueError, RuntimeError):
        copy_bw = None
    scale = 1.0 / math.sqrt(head_dim)
    gen = torch.Generator(device=_DEVICE).manual_seed(0)
    if verbose:
        bw = "copy bandwidth unknown"
        if copy_bw:
            bw = f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (layer 0)"
        name = torch.cuda.get_device_name() if _DEVICE == "cuda" else _DEVICE
        print(f"paged decode attention vs SDPA on contiguous K/V: {name}, {dtype}, "
              f"Hq={q_heads} Hkv={kv_heads} D={head_dim} block_size={block_size}, random data; "
              f"{bw}")
        print(f"{'batch':>5} {'context':>7} {'splits':>6} {'ours us':>8} {'sdpa us':>8} "
              f"{'sdpa/ours':>9} "
              f"{'GB/s':>6} {'of copy':>7}  {'sdpa (backend/layout)':<21}  max|diff|")
    rows = []
    for B in batches:
        for N in contexts:
            c = _case(B, N, q_heads, kv_heads, head_dim, block_size, dtype, gen)
            sdpa_ms, backend, sdpa_out, sdpa_fn = _time_sdpa(c["q"], c["k"], c["v"], scale,
                                                             do_bench)
            nbytes, _ = decode_bytes_and_flops(B, N, q_heads, kv_heads, head_dim,
                                               c["q"].element_size())
            for s in splits:
                args = (c["q"], c["k_cache"], c["v_cache"], c["tables"], c["seq_lens"], scale)
                out = paged_decode_attention(*args, num_splits=s)
                diff = (out.float() - sdpa_out.float()).abs().max().item()
                ms = do_bench(lambda a=args, s=s: paged_decode_attention(*a, num_splits=s),
                              return_mode="median")
                used = s if s is not None else pick_num_splits(B, kv_heads,
                                                               c["tables"].shape[1] * block_size,
                                                               out.device, head_dim)
                gbps = nbytes / (ms * 1e-3) / 1e9
                graph = _graph_pair(graph_replay, sdpa_fn,
                                    lambda a=args, s=s: paged_decode_attention(*a, num_splits=s))
                rows.append(dict(**graph, batch=B, context=N, num_splits=used, auto=s is None,
                                 ours_us=ms * 1e3,
                                 sdpa_us=sdpa_ms * 1e3, speedup=sdpa_ms / ms, sdpa_backend=backend,
                                 gbps=gbps,
                                 of_copy=gbps * 1e9 / copy_bw if copy_bw else None,
                                 max_abs_diff=diff))
                if verbose:
                    r = rows[-1]
                    frac = f"{r['of_copy']:7.0%}" if copy_bw else "      -"
                    g = r["graph_speedup"]
                    print(f"{B:5d} {N:7d} {used:5d}{'*' if s is None else ' '} {r['ours_us']:8.1f} "
                          f"{r['sdpa_us']:8.1f} {r['speedup']:9.2f} {gbps:6.0f} {frac}  "
                          f"{backend:<21}  {diff:.1e}"
                          + (f"  graph: {r['ours_graph_us']:.1f} vs {r['sdpa_graph_us']:.1f} us"
                             f" = {g:.2f}" if g is not None else ""))
            del c
    if verbose:
        print("* = num_splits chosen by pick_num_splits; "
              + ("graph: both sides under CUDA-graph replay (sdpa/ours)"
                 if graph_replay and _DEVICE == "cuda" else GRAPH_SKIPPED))
    return rows


def _graph_pair(enabled: bool, sdpa_fn, ours_fn) -> dict:
    """Both sides timed under CUDA-graph replay, or None with the reason where there is no GPU."""
    if not enabled or _DEVICE != "cuda":
        return dict(ours_graph_us=None, sdpa_graph_us=None, graph_speedup=None,
                    graph_note=GRAPH_SKIPPED if enabled else "not asked for")
    try:
        ours, sdpa = graph_replay_us(ours_fn), graph_replay_us(sdpa_fn)
    except RuntimeError as err:  # e.g. a backend that cannot be captured: say so, keep the row
        torch.cuda.synchronize()
        return dict(ours_graph_us=None, sdpa_graph_us=None, graph_speedup=None,
                    graph_note=f"capture failed: {type(err).__name__}: {str(err)[:100]}")
    return dict(ours_graph_us=ours, sdpa_graph_us=sdpa, graph_speedup=sdpa / ours,
                graph_note="calls captured in one CUDA graph, replays timed between events")
