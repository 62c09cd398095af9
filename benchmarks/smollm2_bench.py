"""SmolLM2-135M: our layer-3 executor and layer-4 engine against transformers, same run.

    python benchmarks/smollm2_bench.py --model smollm2 --device cpu --out DIR         # the GGUF
    python benchmarks/smollm2_bench.py --model smollm2-shape --device cuda --out DIR  # GPU

Rows: batch-1 greedy decode tokens/s (layer 3's generate; transformers' generate, as the
difference between N and 1 new tokens, so prefill is not counted), and offline throughput
(B prompts of P random tokens, N new tokens each, EOS ignored: generated tokens per wall
second) for layer 4's LLM, layer 3's batched generate and transformers' batched generate.
"smollm2" is the Q4_1 GGUF dequantized to fp32 (transformers loads the same file with its
own GGUF loader); "smollm2-shape" is RANDOM weights of its shape (bf16 on a GPU), nothing
downloaded. Each timed call follows an untimed warm-up of the same shape.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import layer3_model as l3
from layer3_model import registry
from layer4_algorithms import LLM


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def hf_model(name: str, model: l3.Model, device: torch.device):
    import transformers

    if name == "smollm2-shape":  # the same random weights, in transformers' layout
        from layer3_model.weights import ours_to_hf

        cfg = transformers.LlamaConfig(**{k: v for k, v in registry.SHAPES[name].items()
                                          if k not in ("model_type", "torch_dtype")})
        hf = transformers.LlamaForCausalLM(cfg)
        hf.load_state_dict(ours_to_hf(model.net), strict=False)
        return hf.to(device=device, dtype=model.net.dtype).eval()
    path = registry.resolve(name)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=model.net.dtype).to(device).eval()


@torch.no_grad()
def hf_generate_s(hf, ids: torch.Tensor, new: int, device: torch.device) -> float:
    kw = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    hf.generate(ids, **kw)  # warm-up
    best = float("inf")
    for _ in range(3):  # the fastest of three: the N - 1 token difference needs both clean
        t0 = _sync(device)
        hf.generate(ids, **kw)
        best = min(best, _sync(device) - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "smollm2-shape"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="prompts in the offline run")
    ap.add_argument("--no-hf", dest="hf", action="store_false")
    ap.add_argument("--out", type=Path, default=Path("results/smollm2"))
    args = ap.parse_args()
    device = torch.device(args.device)
    model = l3.load(args.model, device=device)
    P, N, B = args.prompt_len, args.new_tokens, args.batch
    rows: dict[str, float] = {}
    rows["layer 3 generate, batch 1 decode tok/s"] = l3.benchmark_decode(
        model, batch_size=1, prompt_len=P, new_tokens=N).decode_tokens_per_s
    print("layer 3 batch-1 done", flush=True)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (B, P), generator=gen)
    params = l3.SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    llm = LLM(model, max_model_len=P + N + 16)
    for label, run in (("layer 4 LLM", lambda: llm.generate(prompts.tolist(), params)),
                       ("layer 3 generate", lambda: model.generate_outputs(prompts.tolist(),
                                                                           params))):
        run()
        t0 = _sync(device)
        run()
        rows[f"{label}, offline {B}x{N} tok/s"] = B * N / (_sync(device) - t0)
        print(f"{label} done", flush=True)
    if args.hf:
        hf = hf_model(args.model, model, device)
        one = prompts[:1].to(device)
        decode_s = hf_generate_s(hf, one, N, device) - hf_generate_s(hf, one, 1, device)
        rows["transformers generate, batch 1 decode tok/s"] = (N - 1) / decode_s
        print("transformers batch-1 done", flush=True)
        rows[f"transformers generate, offline {B}x{N} tok/s"] = B * N / hf_generate_s(
            hf, prompts.to(device), N, device)
    import transformers

    record = {"date": datetime.now(timezone.utc).isoformat(), "model": args.model,
              "device": str(device), "dtype": str(model.net.dtype),
              "cpu": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "transformers": transformers.__version__,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "prompt_len": P, "new_tokens": N, "batch": B, "rows": rows,
              "load_average": os.getloadavg()[0], "cores": os.cpu_count()}
    for k, v in rows.items():
        print(f"{k:48} {v:10.1f}")
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{args.model}_{device.type}.json"
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
