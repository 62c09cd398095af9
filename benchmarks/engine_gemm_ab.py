"""The engine with layer 1's skinny GEMM switched off and on, in one process: Llama-3.2-1B's shape
(random bf16 weights), nano-vllm's workload (256 sequences), CUDA graphs, async scheduling.

    python benchmarks/engine_gemm_ab.py [--rounds 2] [--budget-s 80] [--out DIR] [--smoke]

Each round builds the engine off, then on (the triton op set is rebuilt after the switch
flips, so each engine's decode graphs capture that setting's projections), and times the
workload once per setting after the engine's own warm-up; rounds stop when the budget is
spent. Prints each run (tok/s, fraction of the roofline floor, step count) and the on/off
ratio per round; writes DIR/engine_gemm_ab.json when --out is given. --smoke: a tiny model on
the CPU (checks the code; the switch changes nothing there).
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import layer3_model as l3  # noqa: E402
from layer4_algorithms import LLM  # noqa: E402
from layer4_algorithms.bench import engine as L4B  # noqa: E402

SK = importlib.import_module("layer1_kernels.skinny_matmul")
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[engine-gemm +{time.monotonic() - T0:6.1f} s] {msg}", flush=True)


def run(net, wl, on: bool, bw: float, peak: float, smoke: bool) -> dict:
    SK.ENABLED = on
    net.set_backend("triton")
    seqs = len(wl.prompts)
    llm = LLM(l3.Model(net, None), max_num_seqs=seqs, async_scheduling=not smoke, block_size=16,
              max_num_batched_tokens=8192, cuda_graph=not smoke,
              max_model_len=2 * max(len(p) for p in wl.prompts) + 64,
              num_blocks=512 if smoke else None)
    r = L4B.time_engine(llm, wl)
    r["roofline_fraction"] = L4B.roofline_floor_s(net, wl, seqs, bw, peak) / r["seconds"]
    r["skinny_gemm"] = on
    del llm
    gc.collect()
    if not smoke:
        torch.cuda.empty_cache()
    log(f"skinny GEMM {'on ' if on else 'off'}: {r['tokens_per_s']:,.0f} tok/s, "
        f"{100 * r['roofline_fraction']:.1f} % of the roofline floor, {r['steps']} steps, "
        f"{r['seconds']:.3f} s")
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=80.0)
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if not args.smoke and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --smoke: the tiny model on the CPU)")
    shape, dev, dtype = dict(l3.LLAMA_3_2_1B), "cuda", torch.bfloat16
    if args.smoke:
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)
        dev, dtype = "cpu", torch.float32
    log(f"{torch.cuda.get_device_name(0) if not args.smoke else 'cpu (smoke)'}, torch "
        f"{torch.__version__}; TUNED shapes: {sorted(SK.TUNED)}")
    net = l3.random_model(l3.ModelConfig.from_dict(shape), backend="triton", dtype=dtype,
                          device=dev)
    c = l3.load_ceilings("cuda") if not args.smoke else None
    bw, peak = (c.memory_bandwidth, c.flops["bf16"]) if c else (1e11, 1e11)
    seqs, lo, hi = (256, 100, 1024) if not args.smoke else (6, 4, 16)
    wl = L4B.random_workload(seqs, lo, hi, net.config.vocab_size)
    rows, took = [], 0.0
    with torch.no_grad():
        for i in range(args.rounds):
            start = time.monotonic()
            if i and start + took - T0 > args.budget_s:
                log("budget: no further round")
                break
            off, on = (run(net, wl, False, bw, peak, args.smoke),
                       run(net, wl, True, bw, peak, args.smoke))
            rows += [off, on]
            took = time.monotonic() - start
            log(f"round {i + 1}: on / off = {on['tokens_per_s'] / off['tokens_per_s']:.3f}x")
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                (Path(args.out) / "engine_gemm_ab.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
