"""Layer 1's decode MLP in one kernel (gemv_mlp) against the two GEMVs it replaces
(gemv_rms_norm's gate_up, then gemv_silu_mul's down), batch 1, bf16, at the per-rank shapes of
Llama-3.2-1B and Llama-3.1-8B at TP=1/2/4.

    python benchmarks/gemv_mlp_ab.py --out DIR [--budget-s 90]

Every call is timed under CUDA-graph replay with PDL on (as the engine launches them), over
enough weight copies (> 256 MB) that none is in L2 (gemv_shapes_sweep.replay_us). Per shape:
the pair's us, then gemv_mlp's at its default config and a few others (BLOCK_F, BLOCK_K,
BLOCK_H, warps[, stages]), each checked against the pair's output first; "TB/s" = the three
projections' weight bytes / t. Configs of shapes reached after --budget-s are skipped (the
pair and the default still timed). Writes DIR/gemv_mlp_ab.json.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gemv_shapes_sweep import ROTATE_BYTES, replay_us  # noqa: E402

K1 = importlib.import_module("layer1_kernels")
GM = importlib.import_module("layer1_kernels.gemv_mlp")
BF16, EPS = torch.bfloat16, 1e-5
T0 = time.monotonic()

#: name -> (H, F of rank 0)
SHAPES = {"1B": (2048, 8192), "8B TP=4": (4096, 3584), "8B TP=2": (4096, 7168),
          "8B TP=1": (4096, 14336)}
#: (eight warps with stages > 1 spill for sm_90: left out)
CONFIGS = [(64, 128, 256, 8, 1), (64, 128, 256, 4, 3), (64, 128, 128, 4, 3), (32, 128, 256, 8, 1),
           (64, 256, 512, 8, 1),
           (32, 128, 256, 4, 3), (128, 64, 256, 8, 1), (64, 64, 256, 4, 3)]


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def ab_shape(name: str, H: int, F: int, g: torch.Generator, full: bool) -> dict:
    """The pair and gemv_mlp (default, then CONFIGS when `full`) at one shape."""
    nbytes = 3 * F * H * 2
    copies = max(2, math.ceil(ROTATE_BYTES / nbytes))
    ws = [((torch.randn(2 * F, H, device="cuda", generator=g) / H ** 0.5).to(BF16),
           (torch.randn(H, F, device="cuda", generator=g) / F ** 0.5).to(BF16))
          for _ in range(copies)]
    x, r = (torch.randn(1, H, device="cuda", generator=g).to(BF16) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).to(BF16)

    def pair(w_gu, w_d):
        gu, _ = K1.gemv_rms_norm(x, w_gu, nw, EPS, r)
        return K1.gemv_silu_mul(gu, w_d)

    def fused(w_gu, w_d, config):
        return K1.gemv_mlp(x, w_gu, w_d, nw, EPS, r, config=config)[0]
    want = pair(*ws[0])
    row = {"name": name, "H": H, "F": F, "weight_bytes": nbytes,
           "default": list(GM.config_for(F, H, x.device)), "configs": []}
    us = row["pair_us"] = replay_us([lambda a=a, b=b: pair(a, b) for a, b in ws])
    log(f"{name} (H {H}, F {F}): two GEMVs {us:7.2f} us, {nbytes / us / 1e6:.2f} TB/s")
    for config in [None] + (CONFIGS if full else []):
        label = config or tuple(row["default"])
        try:
            y = fused(*ws[0], config)
            err = ((y.float() - want.float()).norm() / want.float().norm()).item()
            if err > 1e-2:
                row["configs"].append({"config": label, "error": f"rel err {err:.2e}"})
                log(f"  gemv_mlp {label}: WRONG, rel err {err:.2e}")
                continue
            us = replay_us([lambda a=a, b=b, c=config: fused(a, b, c) for a, b in ws])
        except Exception as e:  # a config that fails to compile must not end the sweep
            row["configs"].append({"config": label, "error": str(e)[:200]})
            log(f"  gemv_mlp {label}: FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        row["configs"].append({"config": label, "us": us, "rel_err": err,
                               "speedup_vs_pair": row["pair_us"] / us})
        log(f"  gemv_mlp {label}{' (default)' if config is None else ''}: {us:7.2f} us, "
            f"{nbytes / us / 1e6:.2f} TB/s, x{row['pair_us'] / us:.3f} vs the pair, "
            f"rel err {err:.1e}")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=90.0)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", flush=True)
        return 1
    K1.set_decode_pdl(True, early=False)
    result = {"device": torch.cuda.get_device_name(), "shapes": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (H, F) in SHAPES.items():
        result["shapes"].append(ab_shape(name, H, F, g, time.monotonic() - T0 < args.budget_s))
        torch.cuda.empty_cache()
        (args.out / "gemv_mlp_ab.json").write_text(json.dumps(result, indent=1))
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
