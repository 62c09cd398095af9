"""Layer 3's commands for the `stack` CLI (entry point `llm_stack.layers` "3").

`run`: the course model writes a Shakespearean continuation on the CPU, streamed token by
token, and says how fast it went.
`bench`: the course models' CPU decode speed; on a GPU, a random-weight model of
Llama-3.2-1B's shape in bf16: batch-1 decode (CUDA graphs) as tokens/s and memory-bandwidth
utilisation, against transformers' generate on the same shape in the same run; a 2048-token
prefill as model-FLOP utilisation; W8A16 against bf16 decode. What W8A16 costs in quality:
the course models' perplexity on held-out plays in fp32, bf16 and W8A16 (when the corpus has
been prepared: `python -m layer3_model.training.data --out build/course-data`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.console import Console

from layer2_comm import load_ceilings, results_dir, system_info

from . import bench as B
from . import bench_rows as R
from .config import ModelConfig
from .course_model import course_model_dir
from .generate import Model, benchmark_decode, load
from .models_command import models_main as models  # noqa: F401  (`stack models`)
from .quantize import perplexity, quantize_model
from .sampling import SamplingParams
from .shapes import LLAMA_3_2_1B
from .training import load_split
from .weights import random_model

TITLE = "model execution"
console = Console()
PROMPT = "ROMEO.\nBut soft, what light through yonder window breaks?\n\nJULIET.\n"


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="stack run --layer 3",
                                 description="the course model writes a scene")
    ap.add_argument("--model", default=None,
                    help="a name (course, course-draft, smollm2), a HF checkpoint dir, a "
                         ".gguf file or a hub id org/name (default: the course target model)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-tokens", type=int, default=150)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="torch", choices=("torch", "triton", "compile"))
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    model = load(args.model or course_model_dir("target"), backend=args.backend, device=args.device)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens)
    console.print(f"[dim]{args.model or 'course target model'} on {args.device}, "
                  f"backend {args.backend}; temperature {args.temperature}, top-k {args.top_k}, "
                  f"seed {args.seed}[/]\n")
    sys.stdout.write(args.prompt)
    start = time.perf_counter()
    for piece in model.stream(args.prompt, params):
        sys.stdout.write(piece)
        sys.stdout.flush()
    seconds = time.perf_counter() - start
    s = model.stats
    console.print(f"\n\n[bold]{s.generated_tokens} tokens in {seconds:.2f} s[/]: "
                  f"prefill {s.prompt_tokens} tokens at {s.prefill_tokens_per_s:,.0f} tokens/s, "
                  f"decode {s.decode_tokens_per_s:,.1f} tokens/s")
    return 0


def _course_cpu(rows: list[dict], new_tokens: int) -> None:
    threads = torch.get_num_threads()
    for size in ("target", "draft"):
        model = load(course_model_dir(size), device="cpu")
        stats = benchmark_decode(model, batch_size=1, prompt_len=32, new_tokens=new_tokens)
        rows.append({"what": f"course {size}, batch-1 decode, CPU ({threads} threads), fp32",
                     "tokens_per_s": stats.decode_tokens_per_s})


def _course_quality(data_dir: Path, max_tokens: int) -> dict:
    """Perplexity of each course model on the first max_tokens of the held-out plays: fp32,
    bf16 and W8A16 (int8 weights, lm_head too) — what weight-only quantization costs."""
    try:
        plays = load_split(data_dir, "val")
    except FileNotFoundError as err:
        console.print(f"[dim]perplexity rows skipped: {err}[/]")
        return {}
    result = {}
    for size in ("target", "draft"):
        fp32 = load(course_model_dir(size), device="cpu", dtype="float32")
        bf16 = load(course_model_dir(size), device="cpu", dtype="bfloat16")
        ids = fp32.encode("".join(plays))[:max_tokens]
        ppl = {"fp32": perplexity(fp32, ids), "bf16": perplexity(bf16, ids)}
        quantize_model(bf16.net, include_lm_head=True)  # in place: the bf16 model becomes W8A16
        ppl["w8a16"] = perplexity(bf16, ids)
        result[f"course {size} perplexity on {len(ids)} held-out tokens"] = (
            f"fp32 {ppl['fp32']:.3f}, bf16 {ppl['bf16']:.3f}, W8A16 {ppl['w8a16']:.3f} "
            f"({ppl['w8a16'] / ppl['bf16'] - 1:+.2%} vs bf16)")
    return result


def _gpu(rows: list[dict], args: argparse.Namespace) -> dict:
    ceilings = load_ceilings("cuda")
    bw, peak = ceilings.memory_bandwidth, ceilings.flops["bf16"]
    cfg = ModelConfig.from_dict(LLAMA_3_2_1B)
    P, N = args.prompt_len, args.new_tokens
    info = {"copy_bandwidth": bw, "bf16_flops": peak, "prompt_len": P, "new_tokens": N}
    console.print("[bold]Llama-3.2-1B shape, RANDOM bf16 weights[/] (no checkpoint is "
                  f"downloaded): ceilings copy {bw / 1e12:.2f} TB/s, "
                  f"bf16 {peak / 1e12:.0f} TFLOP/s")

    def decode_row(what: str, net, graph: bool) -> float:
        spt = B.best_of(
            lambda: B.decode_seconds_per_token(net, prompt_len=P, new_tokens=N, cuda_graph=graph)
        )
        moved = B.weight_bytes_read(net) + B.kv_bytes_per_position(net) * (P + N / 2)
        rows.append({"what": what, "tokens_per_s": 1 / spt, "ms_per_token": spt * 1e3,
                     "bytes_per_token": moved, "MBU": moved / spt / bw})
        return 1 / spt

    result = {}
    for backend in ("torch", "triton"):
        net = random_model(cfg, backend=backend, dtype=torch.bfloat16, device="cuda")
        result[backend] = decode_row(f"1B decode bs1, {backend} backend, CUDA graph", net, True)
        if backend == "torch":
            decode_row("1B decode bs1, torch backend, eager (no graph)", net, False)
            model = Model(net, None, cuda_graph=True)  # token ids in, no tokenizer
            stats = benchmark_decode(model, batch_size=1, prompt_len=P, new_tokens=N)
            rows.append({"what": "1B generate() end to end bs1, CUDA graph (host sampling)",
                         "tokens_per_s": stats.decode_tokens_per_s})
        rows.append(R.prefill_row(net, args.prefill, backend, peak))  # 5 runs: median, spread
        if backend == "triton":
            quantize_model(net, include_lm_head=True)
            result["w8a16"] = decode_row("1B decode bs1, W8A16 (int8 weights, lm_head too), "
                                         "triton, CUDA graph",
                                         net, True)
        del net
        torch.cuda.empty_cache()
    if args.hf:
        for variant in ("dynamic", "static"):
            try:
                spt = B.hf_decode_seconds_per_token(
                    LLAMA_3_2_1B, variant, prompt_len=P, new_tokens=N
                )
                label = (
                    "static cache, auto-compiled" if variant == "static" else "dynamic cache, eager"
                )
                rows.append({"what": f"transformers generate bs1, {label}", "tokens_per_s": 1 / spt,
                             "ms_per_token": spt * 1e3})
                result[f"hf_{variant}"] = 1 / spt
            except Exception as err:  # noqa: BLE001  (reported in its row, not fatal)
                rows.append({"what": f"transformers generate bs1, {variant} cache: FAILED "
                                     f"{type(err).__name__}: "
                                     f"{str(err).splitlines()[0][:120] if str(err) else ''}"})
        hf_best = max((v for k, v in result.items() if k.startswith("hf_")), default=0.0)
        if hf_best:
            info["ours_over_best_hf"] = max(result["torch"], result["triton"]) / hf_best
    info["w8a16_over_bf16"] = result["w8a16"] / result["triton"]
    return info


def bench(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="stack bench --layer 3", description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers' generate")
    ap.add_argument("--cpu-tokens", type=int, default=64,
                    help="new tokens for the CPU course-model runs")
    ap.add_argument("--val-data", type=Path, default=Path("build/course-data"),
                    help="prepared corpus (python -m layer3_model.training.data) for the "
                         "perplexity rows")
    ap.add_argument("--ppl-tokens", type=int, default=30000,
                    help="held-out tokens scored for perplexity")
    args = ap.parse_args(argv)
    rows: list[dict] = []
    _course_cpu(rows, args.cpu_tokens)
    quality = _course_quality(args.val_data, args.ppl_tokens)
    if torch.cuda.is_available():
        info = _gpu(rows, args)
    else:
        info = {"gpu": "none visible: GPU rows skipped"}
    info.update(quality)
    console.print(R.table(R.annotate(rows, info)))  # ratio to a reference, roofline fraction
    for k, v in info.items():
        console.print(f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v}")
    out = results_dir(3) / "bench.json"
    record = {"date": datetime.now(timezone.utc).isoformat(),
              "system": system_info(), "rows": rows, "info": info}
    out.write_text(json.dumps(record, indent=1, default=str))
    console.print(f"wrote {out}")
    return 0
