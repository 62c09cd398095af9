"""The batch-1 decode kernels on a GPU: layer 1's decode GEMV against cuBLAS at Llama-3.2-1B's
projection shapes (a tile sweep), its fused prologues, and the split decode attention on the
contiguous cache against the SDPA path it replaces; all timed under CUDA-graph replay.

    python benchmarks/decode_kernels_bench.py --out DIR [--quick]

Weights rotate over enough copies (> 200 MB) that no call finds its matrix in L2 (50 MB on an
H100). Writes DIR/decode_kernels.json, with `best` = the fastest (BLOCK_N, BLOCK_K, warps)
per shape, which `--apply` style callers copy into layer1_kernels.gemv.TUNED.
"""
# ruff: noqa: B023  (every lambda is captured into a graph inside its own loop iteration)
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

import layer3_model as l3

K1 = l3.comm.kernels
SHAPES = {"qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (16384, 2048),
          "down": (2048, 8192), "lm_head": (128256, 2048)}


def graph_us(fns: list, replays: int = 5) -> float:
    """Microseconds per call: every fn captured once in one graph, replayed `replays` times."""
    return l3.graph_replay_us(fns, replays=replays, warmup=1)


def weights(n: int, k: int) -> list[torch.Tensor]:
    copies = max(2, math.ceil(200e6 / (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def sweep(quick: bool) -> dict:
    out = {}
    x = torch.randn(1, 8192 * 2, device="cuda", dtype=torch.bfloat16)
    configs = [(bn, bk, w) for bn in (2, 4, 8, 16) for bk in (512, 1024, 2048) for w in (4, 8)
               if bn * bk // (32 * w) <= 128]
    if quick:
        configs = [(8, 512, 4), (16, 512, 4), (16, 1024, 8)]
    for name, (n, k) in SHAPES.items():
        ws = weights(n, k)
        xa = x[:, :k]
        nbytes = n * k * 2
        cublas = graph_us([lambda w=w: F.linear(xa, w) for w in ws])
        rows = []
        for cfg in configs:
            if cfg[1] > k:
                continue
            try:
                us = graph_us([lambda w=w, c=cfg: K1.gemv(xa, w, config=c) for w in ws])
            except Exception as e:  # a config that does not compile: note it, go on
                rows.append({"config": cfg, "error": repr(e)[:200]})
                continue
            rows.append({"config": cfg, "us": us, "TBps": nbytes / us / 1e6})
        ok = [r for r in rows if "us" in r]
        best = min(ok, key=lambda r: r["us"])
        err = (K1.gemv(xa, ws[0], config=best["config"]).float()
               - F.linear(xa, ws[0]).float()).norm() / F.linear(xa, ws[0]).float().norm()
        out[name] = {"N": n, "K": k, "cublas_us": cublas, "cublas_TBps": nbytes / cublas / 1e6,
                     "best": best, "rel_err": err.item(), "rows": rows}
        print(f"{name:8s} N={n:6d} K={k:5d} cuBLAS {cublas:7.1f} us "
              f"{nbytes / cublas / 1e6:4.2f} TB/s"
              f" | gemv best {best['config']} {best['us']:7.1f} us {best['TBps']:4.2f} TB/s"
              f" | rel err {err.item():.1e}", flush=True)
        del ws
    return out


def prologues(best: dict) -> dict:
    """The fused prologues at each shape's best config vs the unfused pair (norm + cuBLAS)."""
    res = {}
    for name in ("qkv", "gate_up", "down", "lm_head"):
        n, k = SHAPES[name]
        cfg = best[name]
        ws = weights(n, k)
        kin = 2 * k if name == "down" else k
        x = torch.randn(1, kin, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nw = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        if name == "down":
            fused = [lambda w=w: K1.gemv_silu_mul(x, w, config=cfg) for w in ws]
            unfused = [lambda w=w: F.linear(K1.silu_and_mul(x), w) for w in ws]
            y, ref = K1.gemv_silu_mul(x, ws[0], config=cfg), F.linear(K1.silu_and_mul(x), ws[0])
        else:
            fused = [lambda w=w: K1.gemv_rms_norm(x, w, nw, 1e-5, r, config=cfg) for w in ws]
            unfused = [lambda w=w: F.linear(K1.rms_norm(x, nw, eps=1e-5, residual=r)[0], w)
                       for w in ws]
            y = K1.gemv_rms_norm(x, ws[0], nw, 1e-5, r, config=cfg)[0]
            ref = F.linear(K1.rms_norm(x, nw, eps=1e-5, residual=r)[0], ws[0])
        err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
        res[name] = {"fused_us": graph_us(fused), "unfused_us": graph_us(unfused), "rel_err": err}
        print(f"{name:8s} fused prologue {res[name]['fused_us']:7.1f} us vs norm/silu + cuBLAS "
              f"{res[name]['unfused_us']:7.1f} us, rel err {err:.1e}", flush=True)
        del ws
    return res


def attention() -> list[dict]:
    """Batch-1 decode attention on the 1B shape over a contiguous cache of 385 slots (the
    decode bench's), split kernel vs the SDPA path, at several filled lengths; 16 layers'
    worth of calls per graph (one cache per layer, as in the model)."""
    rows = []
    Hq, Hkv, D, L = 32, 8, 64, 385
    caches = [(torch.randn(1, L, Hkv, D, device="cuda", dtype=torch.bfloat16),
               torch.randn(1, L, Hkv, D, device="cuda", dtype=torch.bfloat16)) for _ in range(16)]
    q = torch.randn(1, Hq, D, device="cuda", dtype=torch.bfloat16)
    from layer3_model.backends import _num_splits
    from layer3_model.decode_attention import padded_decode_attention
    for n in (129, 256, 384):
        seq = torch.tensor([n], device="cuda")
        splits = _num_splits(1, Hkv, L, q.device)
        ours = [lambda c=c: K1.paged_decode(q, c[0], c[1], None, seq, 0.125, None, splits)
                for c in caches]
        sdpa = [lambda c=c: padded_decode_attention(q, c[0].transpose(1, 2),
                                                    c[1].transpose(1, 2), seq, 0.125, None)
                for c in caches]
        a = K1.paged_decode(q, caches[0][0], caches[0][1], None, seq, 0.125, None, splits)
        b = padded_decode_attention(q, caches[0][0].transpose(1, 2), caches[0][1].transpose(1, 2),
                                    seq, 0.125, None)
        row = {"seq_len": n, "splits": splits, "ours_us": graph_us(ours),
               "sdpa_us": graph_us(sdpa),
               "max_abs_diff": (a.float() - b.float()).abs().max().item()}
        for s in (1, 4, 8):
            row[f"ours_us_splits{s}"] = graph_us(
                [lambda c=c, s=s: K1.paged_decode(q, c[0], c[1], None, seq, 0.125, None, s)
                 for c in caches])
        rows.append(row)
        print(f"attention len {n}: ours {row['ours_us']:.1f} us ({splits} splits; "
              f"1/4/8: {row['ours_us_splits1']:.1f}/{row['ours_us_splits4']:.1f}/"
              f"{row['ours_us_splits8']:.1f}) vs SDPA path {row['sdpa_us']:.1f} us, "
              f"diff {row['max_abs_diff']:.1e}", flush=True)
    return rows


def paged_sweep(budget_s: float = 60.0) -> list[dict]:
    """Layer 4's paged decode kernel at its bench's shapes (Hq 32, Hkv 8, D 64, pages of 16,
    bf16, blocks shuffled) against SDPA on contiguous K/V, both under CUDA-graph replay (20
    calls per graph), over launch configs and split counts; stops after budget_s."""
    import time

    from triton.testing import do_bench

    from layer4_algorithms.bench.paged_attention import _case, _time_sdpa
    from layer4_algorithms.kv.paged_attention import pick_num_splits
    t0, rows = time.time(), []
    gen = torch.Generator(device="cuda").manual_seed(0)
    cfgs = [(64, 4, 2), (32, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (64, 8, 3)]
    for B in (1, 4, 8, 32):
        for N in (1024, 4096, 16384):
            if time.time() - t0 > budget_s:
                return rows
            c = _case(B, N, 32, 8, 64, 16, torch.bfloat16, gen)
            _, backend, ref, sdpa_fn = _time_sdpa(c["q"], c["k"], c["v"], 0.125, do_bench)
            sdpa = graph_us([sdpa_fn] * 20)
            auto = pick_num_splits(B, 8, c["tables"].shape[1] * 16, c["q"].device)
            row = {"batch": B, "context": N, "sdpa_graph_us": sdpa, "auto_splits": auto,
                   "results": []}
            for splits in sorted({auto, max(1, auto // 2), min(64, auto * 2)}):
                for bn, warps, stages in cfgs:
                    cfg = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages}

                    def call(cfg=cfg, splits=splits, c=c):
                        return K1.paged_decode(c["q"], c["k_cache"], c["v_cache"], c["tables"],
                                               c["seq_lens"], 0.125, None, splits, config=cfg)
                    err = (call().float() - ref.float()).abs().max().item()
                    us = graph_us([call] * 20)
                    row["results"].append({"splits": splits, "config": cfg, "us": us,
                                           "ratio": sdpa / us, "max_abs_diff": err})
            best = max(row["results"], key=lambda r: r["ratio"])
            dflt = next(r for r in row["results"] if r["splits"] == auto
                        and r["config"] == {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2})
            row["best"], row["default"] = best, dflt
            rows.append(row)
            print(f"paged B={B:2d} N={N:5d}: SDPA {sdpa:6.1f} us ({backend}); default "
                  f"{dflt['us']:6.1f} us = {dflt['ratio']:.2f}x ({auto} splits); best "
                  f"{best['us']:6.1f} us = {best['ratio']:.2f}x {best['splits']} splits "
                  f"{tuple(best['config'].values())}", flush=True)
            del c
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--paged-only", action="store_true", help="only the paged-kernel sweep")
    args = ap.parse_args()
    if args.paged_only:
        rows = paged_sweep(35.0)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "paged_sweep.json").write_text(json.dumps(rows, indent=1, default=str))
        return
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name()}
    with torch.no_grad():
        result["attention"] = attention()
        result["gemv"] = sweep(args.quick)
        best = {k: tuple(v["best"]["config"]) for k, v in result["gemv"].items()}
        result["best"] = {f"{SHAPES[k][0]}x{SHAPES[k][1]}": v for k, v in best.items()}
        result["prologues"] = prologues(best)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_kernels.json").write_text(json.dumps(result, indent=1, default=str))
    print("TUNED =", {SHAPES[k]: v for k, v in best.items()})


if __name__ == "__main__":
    main()
