"""A tensor-parallel decoder layer's projections and all-reduces, timed per layer on every GPU:
what each all-reduce variant costs where decode runs it, between the GEMVs (batch 1) or the
GEMMs (batch 32) of layer 5's shard.

    python benchmarks/tp_decode_chain.py [--rows 1,32] [--variants ...] [--json PATH]

Every visible GPU is a rank (Llama-3.1-8B's rank-0 shapes at TP = the GPU count, bf16). One
layer at batch 1 is layer 3's fused decode path without attention: qkv = gemv_rms_norm(x +
residual), o_proj = gemv over the q part, ALL-REDUCE, gate_up = gemv_rms_norm(+ residual), down
= gemv_silu_mul, ALL-REDUCE. At batch 32 the general path: rms_norm, F.linear (cuBLAS) qkv and
o_proj, ALL-REDUCE + rms_norm (two launches or the fused kernel), gate_up, silu_and_mul, down,
ALL-REDUCE (+ the next layer's norm). A CUDA graph holds `--layers` such layers over distinct
weights (more bytes than L2), replayed; us per layer = replay time / layers, the median of
`--iters` replays, the slowest rank's. Variants of the all-reduce (same weights, same run):

  none        no all-reduce (each rank's partial sums go on): the projections alone
  one_shot    layer 2's barrier one-shot           one_shot+pdl  launched as a PDL dependent
  ll          the low-latency one-shot (packets)   ll+pdl        the same, PDL
              (at batch 32 too: 256 KiB, past the class's LL_MAX_BYTES)
  ll+send     (batch 1) o_proj and down through PeerAllReduce.gemv_all_reduce: the GEMV sends
              its outputs as LL packets from its epilogue, a PDL kernel polls and sums
  nccl        dist.all_reduce
  fused       (batch 32) all-reduce + residual + RMSNorm in one kernel (one_shot otherwise)

Before timing, each variant's layer output is checked against `one_shot`'s, or the first
variant of ours run when one_shot is not (the same bits for ours; NCCL within bf16 rounding;
none is not checked). Prints a line per (rows, variant),
flushed; --json writes the rows.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

T0 = time.monotonic()
H, F_FULL, HQ, HKV, D = 4096, 14336, 32, 8, 128
EPS = 1e-5
VARIANTS = {1: ("none", "one_shot", "one_shot+pdl", "ll", "ll+pdl", "ll+send", "nccl"),
            32: ("none", "one_shot", "ll", "fused", "nccl")}


def _weights(world: int, layers: int, dev, g) -> list[dict]:
    hq, hkv, f = HQ // world, max(HKV // world, 1), F_FULL // world
    out = []
    for _ in range(layers):
        def w(n, k):
            return (0.02 * torch.randn(n, k, device=dev, generator=g)).to(torch.bfloat16)
        out.append(dict(qkv=w((hq + 2 * hkv) * D, H), o=w(H, hq * D), gu=w(2 * f, H),
                        down=w(H, f), n1=1 + 0.1 * torch.randn(H, device=dev, generator=g)
                        .to(torch.bfloat16),
                        n2=1 + 0.1 * torch.randn(H, device=dev, generator=g).to(torch.bfloat16),
                        q=hq * D))
    return out


def _reduce(ar, variant: str):
    """The all-reduce of one variant, in place (None: no all-reduce)."""
    import torch.distributed as dist

    if variant == "none":
        return lambda t: t
    if variant == "nccl":
        def nccl(t):
            dist.all_reduce(t)
            return t
        return nccl
    return lambda t: ar(t, out=t)


def _setup(ar, variant: str) -> None:
    import layer1_kernels as kernels

    ar.pdl = "+pdl" in variant or variant == "ll+send"
    ar.gemv_send = variant == "ll+send"
    kernels.set_decode_pdl(True, early=False)  # layer 1's GEMVs: PDL on as the engine runs them
    ar.low_latency = variant.startswith("ll")
    # plain LL at every size its region holds (batch 32's 256 KiB too), else the class's limit
    ar.LL_MAX_BYTES = ar.LL_SLOT_BYTES if variant.startswith("ll") else type(ar).LL_MAX_BYTES


def _batch1_layer(kernels, ar, variant, lw, x, res):
    reduce = _reduce(ar, variant)
    y, h = kernels.gemv_rms_norm(x, lw["qkv"], lw["n1"], EPS, res)
    if variant == "ll+send":
        a = y[:, : lw["q"]]
        if not ar.sends_from_gemv(a, lw["o"]):
            raise RuntimeError("gemv_all_reduce would not take the fused path here")
        o = ar.gemv_all_reduce(a, lw["o"])
        gu, h2 = kernels.gemv_rms_norm(o, lw["gu"], lw["n2"], EPS, h)
        return ar.gemv_all_reduce(gu, lw["down"], silu=True), h2
    o = reduce(kernels.gemv(y[:, : lw["q"]], lw["o"]))
    gu, h2 = kernels.gemv_rms_norm(o, lw["gu"], lw["n2"], EPS, h)
    return reduce(kernels.gemv_silu_mul(gu, lw["down"])), h2


def _batch32_layer(kernels, ar, variant, lw, x, res, after_norm):
    """x: this layer's input already normalised (y); res: the residual stream (h). Returns the
    next layer's (y, h)."""
    import torch.nn.functional as F

    fused = variant.startswith("fused")

    def reduce_norm(t, r, w):
        if fused:
            return ar.all_reduce_rms_norm(t, r, w, EPS)
        return kernels.rms_norm(_reduce(ar, variant)(t), w, eps=EPS, residual=r)

    qkv = F.linear(x, lw["qkv"])
    o = F.linear(qkv[:, : lw["q"]].contiguous(), lw["o"])
    y, h = reduce_norm(o, res, lw["n2"])
    gu = F.linear(y, lw["gu"])
    d = F.linear(kernels.silu_and_mul(gu), lw["down"])
    return reduce_norm(d, h, after_norm)


def _rank(rows_list: list[int], variants: dict, layers: int, iters: int) -> list[dict]:
    import torch.distributed as dist

    import layer1_kernels as kernels
    from layer2_comm import PeerAllReduce
    from layer2_comm.bench_bandwidth import time_collective

    dev = torch.device("cuda", torch.cuda.current_device())
    world, rank = dist.get_world_size(), dist.get_rank()
    PeerAllReduce.low_latency = True  # the LL region is made at construction; toggled per variant
    ar = PeerAllReduce(device=dev)
    g = torch.Generator(device=dev).manual_seed(1 + rank)
    lws = _weights(world, layers, dev, g)
    out_rows = []
    for rows in rows_list:
        x0 = torch.randn(rows, H, device=dev, generator=g).to(torch.bfloat16)
        r0 = torch.randn(rows, H, device=dev, generator=g).to(torch.bfloat16)
        dist.broadcast(x0, 0)  # the same activations on every rank, as in a TP forward
        dist.broadcast(r0, 0)

        def chain(variant):
            x, res = x0, r0
            for lw in lws:
                if rows == 1:
                    x, res = _batch1_layer(kernels, ar, variant, lw, x, res)
                else:
                    x, res = _batch32_layer(kernels, ar, variant, lw, x, res, lw["n1"])
            return x, res

        ref, ref_name = None, ""
        for variant in variants[rows]:
            _setup(ar, variant)
            row = dict(world=world, rows=rows, variant=variant, layers=layers)
            try:
                out = chain(variant)  # compiles; the check
                torch.cuda.synchronize()
                mine = variant not in ("none", "nccl")
                if variant == "one_shot" or (mine and ref is None
                                             and "one_shot" not in variants[rows]):
                    ref, ref_name = out, variant
                elif ref is not None and variant != "none":
                    exact = all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
                    close = all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)
                                for a, b in zip(out, ref, strict=True))
                    row["same_as"] = ref_name
                    row["same_as_ref"] = "bits" if exact else ("close" if close else "NO")
                side = torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    chain(variant)
                torch.cuda.current_stream(dev).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    chain(variant)
                samples = time_collective(graph.replay, iters, 3, dev)
                del graph
                row["us_per_layer"] = 1e6 * statistics.median(samples) / layers
                ar.check()
            except Exception as exc:  # noqa: BLE001 - reported per variant
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            out_rows.append(row)
    _setup(ar, "one_shot")
    ar.close()
    return out_rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--variants", default="",
                    help="comma-separated subset of the variants (default: all for each rows)")
    ap.add_argument("--layers", type=int, default=8,
                    help="layers (distinct weights) in one graph: 8 x 218 MB at TP=2")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=150.0)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    from layer2_comm import launch

    world = torch.cuda.device_count()
    if world < 2:
        ap.error("needs 2 or more GPUs (one rank each)")
    rows = [int(r) for r in args.rows.split(",")]
    pick = set(filter(None, args.variants.split(",")))
    variants = {r: tuple(v for v in VARIANTS.get(r, VARIANTS[32]) if not pick or v in pick)
                for r in rows}
    print(f"[tp-chain +{time.monotonic() - T0:6.1f} s] {world} ranks ({torch.cuda.get_device_name(0)}),"
          f" rows {rows}, {args.layers} layers a graph", flush=True)
    result = launch(_rank, world, rows, variants, args.layers, args.iters, backend="nccl",
                    timeout_s=args.timeout)[0]
    base = {r["rows"]: r.get("us_per_layer") for r in result if r["variant"] == "none"}
    for r in result:
        if "error" in r:
            print(f"[tp-chain] TP={r['world']} rows {r['rows']:>2} {r['variant']:13s} "
                  f"FAILED: {r['error']}", flush=True)
            continue
        extra = ""
        if base.get(r["rows"]) and r["variant"] != "none":
            r["all_reduce_us"] = (r["us_per_layer"] - base[r["rows"]]) / 2
            extra = f"  ({r['all_reduce_us']:5.2f} us per all-reduce over none)"
        same = f"  same as {r['same_as']}: {r['same_as_ref']}" if "same_as_ref" in r else ""
        print(f"[tp-chain] TP={r['world']} rows {r['rows']:>2} {r['variant']:13s} "
              f"{r['us_per_layer']:7.2f} us/layer{extra}{same}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(0),
                                                   torch=torch.__version__, rows=result),
                                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
