"""Layer 4's commands for the `stack` CLI (entry point `llm_stack.layers` "4").

`run`: the engine serves the course model on the CPU (demo.py).
`bench`: nano-vllm's throughput workload (random prompts, input and output lengths uniform)
through our engine (continuous vs static batching), layer 3's contiguous executor and
transformers' generate, and TTFT with and without the prefix cache: a small version with the
course model on the CPU, and on a GPU a random-weight Llama-3.2-1B in bf16.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import layer3_model as l3

from ..engine import LLM
from . import engine as B
from .demo import _ms, console, run  # noqa: F401  (run: the entry point's)
from .rows import annotate
from .speculative import bench_speculative, format_bench

TITLE = "paged KV cache, prefix caching, continuous batching"
def results_dir() -> Path:
    """Layer 0's convention ($LLM_STACK_RESULTS/layer4), passed up by name."""
    return l3.results_dir(4)


def bench_table(rows: list[dict]) -> Table:
    """Every row's figure, its ratio to the reference named in the JSON, and its roofline
    fraction, readable at 80 columns: an unmeasured roofline shows as "-*" with its note in
    the caption; TTFT, preemptions and other details go to the notes column. Speculative
    decoding shows its geometric means (the per-prompt rows are in format_bench's table)."""
    return l3.rows_table(4, (("what", "left"), ("tok/s", "right"), ("ratio", "right"),
                             ("roofline", "right"), ("notes", "left")), rows, _cells)


def _cells(r: dict, notes: list[str]) -> list[str] | None:
    if r["what"].startswith("speculative") and ", prompt " in r["what"]:
        return None  # per prompt: in the speculative table above and the JSON
    roof = l3.unmeasured_roofline(r, notes) or f"{r['roofline_fraction']:.0%}"
    extra = [f"TTFT {_ms(r['mean_ttft_s'])} ms"] if r.get("mean_ttft_s") is not None else []
    extra += [f"{k}={r[k]:.3g}" if isinstance(r[k], float) else f"{k}={r[k]}"
              for k in ("preemptions", "prefix_hit_rate", "steps", "same_outputs",
                        "matches_greedy", "acceptance_rate") if r.get(k) is not None]
    what = r["what"].replace(", geometric mean over the prompts", " (geomean)")
    return [f"{r['device']}: {what}", f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "",
            f"{r['ratio']:.2f}x" if r.get("ratio") is not None else "-", roof, ", ".join(extra)]


def _throughput(rows: list[dict], model: l3.Model, wl: B.Workload, *, small_batch: int, device: str,
                hf_source, floor, llm_kwargs: dict, hf: bool, layer3: bool) -> None:
    def add(what: str, r: dict) -> None:
        r = {"what": what, "device": device, **r}
        if floor:
            r["roofline_fraction"] = floor(r.get("max_num_seqs", small_batch)) / r["seconds"]
        rows.append(r)

    for seqs, policy in ((len(wl.prompts), "continuous"), (small_batch, "continuous"),
                         (small_batch, "static")):
        llm = LLM(model, max_num_seqs=seqs, scheduling=policy, **llm_kwargs)
        add(f"ours, {policy} batching, max_num_seqs={seqs}",
            {**B.time_engine(llm, wl), "max_num_seqs": seqs})
        del llm
        B.release_memory()
    if layer3:
        add(f"layer 3 generate, contiguous cache, batches of {small_batch}",
            B.time_layer3(model, wl, small_batch))
    if hf:
        try:
            m = B.hf_model(hf_source, device, model.net.dtype)
            add(f"transformers generate, padded batches of {small_batch}",
                B.time_hf(m, wl, small_batch))
            del m
        except Exception as err:  # noqa: BLE001  (reported in the table, not fatal)
            rows.append({"what": f"transformers generate: FAILED {type(err).__name__}: "
                                 f"{str(err)[:120]}",
                         "device": device})
        B.release_memory()


def _prefix(rows: list[dict], model: l3.Model, device: str, llm_kwargs: dict, **shape) -> None:
    kw = {**llm_kwargs, "max_num_seqs": shape["num_seqs"]}
    on = B.prefix_ttft(model, enable_prefix_caching=True, **shape, **kw)
    off = B.prefix_ttft(model, enable_prefix_caching=False, **shape, **kw)
    same = on.pop("outputs") == off.pop("outputs")
    what = (f"{shape['num_seqs']} requests sharing a {shape['prefix_len']}-token prefix "
            f"(+{shape['suffix_len']} own)")
    rows.append({"what": f"{what}, prefix cache ON", "device": device, **on, "same_outputs": same})
    rows.append({"what": f"{what}, prefix cache off", "device": device, **off,
                 "ttft_speedup": off["mean_ttft_s"] / on["mean_ttft_s"]})


def bench(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="stack bench --layer 4", description=__doc__.split("\n")[0])
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64,
                    help="fixed batch for static / layer 3 / transformers (GPU)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--backend", default="triton", choices=l3.BACKENDS)
    ap.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false")
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers' generate")
    ap.add_argument("--no-gpu", dest="gpu", action="store_false")
    ap.add_argument("--cpu-num-seqs", type=int, default=16)
    ap.add_argument("--no-cpu", dest="cpu", action="store_false",
                    help="skip the course-model CPU rows")
    ap.add_argument("--no-spec", dest="spec", action="store_false",
                    help="skip speculative decoding")
    ap.add_argument("--spec-repeats", type=int, default=3)
    ap.add_argument("--spec-clock", choices=("wall", "cpu"), default="wall",
                    help="speculation's clock: cpu = tokens per second of the bench thread's "
                         "CPU time (steadier on a shared, loaded CPU)")
    ap.add_argument("--spec-devices", default="auto",
                    help="comma list (cpu,cuda); auto: the CPU and any GPU")
    ap.add_argument("--spec-ks", default="2,3,4,5,6", help="draft k values (comma list)")
    ap.add_argument("--spec-dynamic", default="3:0.4,4:0.3",
                    help="draft k:stop_below pairs (comma list; '' for none)")
    ap.add_argument("--spec-ngram-ks", default="2,4,6", help="n-gram k values")
    ap.add_argument("--spec-hybrid-ks", default="3,4,6", help="n-gram-then-draft k values")
    ap.add_argument("--spec-serving-draft", dest="spec_lean", action="store_false",
                    help="draft steps through layer 3's serving forward (not the lean step)")
    ap.add_argument("--only", choices=("all", "throughput", "kernel", "spec"), default="all",
                    help="run one part of the benchmark")
    args = ap.parse_args(argv)
    parts = {"throughput", "kernel", "spec"} if args.only == "all" else {args.only}
    gpu = args.gpu and torch.cuda.is_available()
    rows: list[dict] = []
    info: dict = {}
    if "throughput" in parts:
        if args.cpu:
            _cpu(rows, args, info)
        if gpu:
            _gpu(rows, args, info)
        else:
            info["gpu"] = "none visible (or --no-gpu): GPU rows skipped"
    if "kernel" in parts and (gpu or args.only == "kernel"):
        info["paged_decode_kernel"] = _kernel()
    if "spec" in parts and args.spec:
        info["speculative"] = _spec(args)
    _print(rows, info, name="bench.json" if args.only == "all" else f"bench_{args.only}.json")
    return 0


def _cpu(rows: list[dict], args: argparse.Namespace, info: dict) -> None:
    course = l3.load(l3.course_model_dir("target"), device="cpu", dtype="float32")
    wl = B.random_workload(args.cpu_num_seqs, 20, 100, course.config.vocab_size)
    console.print(f"[bold]CPU[/]: course model, {args.cpu_num_seqs} sequences, lengths 20-100")
    cpu_kw = dict(block_size=16, num_blocks=1024, max_num_batched_tokens=512)
    _throughput(rows, course, wl, small_batch=4, device="cpu",
                hf_source=str(l3.course_model_dir("target")),
                floor=None, llm_kwargs=cpu_kw, hf=args.hf, layer3=True)
    _prefix(rows, course, "cpu", cpu_kw, prefix_len=256, suffix_len=16, num_seqs=8, max_tokens=4)
    info["cpu_workload"] = {"num_seqs": args.cpu_num_seqs, "lengths": [20, 100]}


def _kernel() -> list[dict]:
    """Paged decode attention vs SDPA on contiguous K/V at equal context (Llama-3.2-1B heads)."""
    if not torch.cuda.is_available():
        console.print("paged decode kernel: no CUDA GPU here, skipped (the CPU runs the torch "
                      "reference)")
        return []
    from .paged_attention import bench_paged_decode
    console.print("[bold]paged decode attention[/] vs SDPA over contiguous K/V, bf16, 32/8 heads, "
                  "D 64")
    return bench_paged_decode()


def _spec(args: argparse.Namespace) -> dict:
    """Speculative decoding with the course target + draft pair, batch 1 greedy: on the CPU
    (1 thread: small matmuls gain nothing from more) and, where there is one, on the GPU."""
    results = {}
    devices = args.spec_devices.split(",") if args.spec_devices != "auto" else \
        ["cpu"] + (["cuda"] if args.gpu and torch.cuda.is_available() else [])

    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split(",") if x.strip())

    dynamic = tuple((int(k), float(sb)) for k, sb in
                    (pair.split(":") for pair in args.spec_dynamic.split(",") if pair.strip()))
    for device in devices:  # progress lines as rows finish: a run cut off still shows its pace
        result = bench_speculative(repeats=args.spec_repeats, device=device,
                                   threads=1 if device == "cpu" else None,
                                   ks=ints(args.spec_ks), dynamic=dynamic,
                                   ngram_ks=ints(args.spec_ngram_ks),
                                   hybrid_ks=ints(args.spec_hybrid_ks),
                                   clock=args.spec_clock if device == "cpu" else "wall",
                                   progress=lambda line: print(line, flush=True),
                                   lean_draft=args.spec_lean)
        console.print(format_bench(result))
        results[device] = result
    return results


def _gpu(rows: list[dict], args: argparse.Namespace, info: dict) -> None:
    cfg = l3.ModelConfig.from_dict(l3.LLAMA_3_2_1B)
    net = l3.random_model(cfg, backend=args.backend, dtype=torch.bfloat16, device="cuda")
    model = l3.Model(net, None)
    ceilings = l3.load_ceilings("cuda")
    bw, peak = ceilings.memory_bandwidth, ceilings.flops["bf16"]
    wl = B.random_workload(args.num_seqs, args.min_len, args.max_len, cfg.vocab_size)
    console.print("[bold]GPU[/]: Llama-3.2-1B shape, RANDOM bf16 weights (nothing downloaded), "
                  "backend "
                  f"{args.backend}; {args.num_seqs} sequences, lengths "
                  f"{args.min_len}-{args.max_len}; ceilings "
                  f"{bw / 1e12:.2f} TB/s, {peak / 1e12:.0f} TFLOP/s bf16")
    info.update(gpu=torch.cuda.get_device_name(), backend=args.backend, cuda_graph=args.cuda_graph,
                gpu_workload={"num_seqs": args.num_seqs, "lengths": [args.min_len, args.max_len],
                              "input_tokens": wl.input_tokens, "output_tokens": wl.output_tokens},
                copy_bandwidth=bw, bf16_flops=peak)
    kw = dict(block_size=16, max_num_batched_tokens=args.max_num_batched_tokens,
              cuda_graph=args.cuda_graph,
              max_model_len=2 * args.max_len + 64)
    _throughput(rows, model, wl, small_batch=args.batch, device="cuda", hf_source=l3.LLAMA_3_2_1B,
                floor=lambda seqs: B.roofline_floor_s(net, wl, seqs, bw, peak),
                llm_kwargs=kw, hf=args.hf,
                layer3=False)
    _prefix(rows, model, "cuda", kw, prefix_len=args.prefix_len, suffix_len=64, num_seqs=32,
            max_tokens=16)


def _print(rows: list[dict], info: dict, name: str = "bench.json") -> None:
    rows = annotate(rows, info)  # ratio to a reference of this run, roofline fraction; kernel/spec
    if rows:
        (console if console.is_terminal else Console(width=80)).print(bench_table(rows))
    for k, v in info.items():
        if k not in ("speculative", "paged_decode_kernel"):  # printed as tables above
            console.print(f"{k}: {v}")
    out = results_dir() / name
    out.write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(),
                               "torch": torch.__version__,
                               "python": sys.version.split()[0], "rows": rows,
                               "info": info}, indent=1, default=str))
    console.print(f"wrote {out}")
