"""The triton backend against the torch backend: decode tokens/s at batch 1-256 on the
Llama-3.2-1B and Llama-3.1-8B shapes (random bf16 weights drawn on the GPU), CUDA graphs on.

    python benchmarks/backend_sweep.py --shape 8b --out DIR [--batches 1,8,32,128,256]
    python benchmarks/backend_sweep.py --shape 1b --smoke --out DIR   # tiny model, CPU, eager

Per (backend, batch), two measurements:
- step: one decode step over layer 4's paged cache (every sequence CONTEXT tokens long, K/V
  random, blocks shuffled) through layer 4's CudaGraphRunner buffers, captured as one CUDA
  graph and replayed: the GPU's time alone, tok/s = batch / step time, and MBU (weights + the
  K/V read, over layer 0's copy bandwidth). At --general-batches the triton backend is also
  timed with its fused small-batch kernels forced on ("triton-fused", up to gemv.MAX_ROWS)
  and off ("triton-general": ops.decode None): those rows choose how many tokens the fused
  path takes (backends.FUSED_DECODE_MAX_TOKENS).
- engine: layer 4's LLM.generate (cuda_graph=True, prefix caching off) of `batch` random
  128-token prompts, 64 new tokens, greedy, EOS ignored: decode tok/s = batch * 63 /
  (t(64 tokens) - t(1 token)), the better of two (the prefill cancels), as layer 5's
  tp_gpu_bench measures; with the count of decode steps the graphs ran (the rest ran eagerly)
  and t(1 token) ("prefill+1": the B prompts' prefill and one token). The prefill does not
  cancel entirely: with 64 tokens the steps that admit new prompts also carry the decodes of
  those admitted before (mixed steps, eager), which a 1-token run has not.
Last, at --profile-batch, the top kernels of one replayed step per backend (torch.profiler).

Each row is printed (flushed) and the JSON rewritten as soon as it is measured; past
--budget-s the remaining measurements are skipped (said so), so a run cut short keeps its rows.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import json
import time
from pathlib import Path

import torch

import layer3_model as l3
from layer3_model import bench as L3B
from layer4_algorithms import LLM, PagedKVCache
from layer4_algorithms.cuda_graph_runner import CudaGraphRunner
from layer5_parallel.planner import LLAMA_3_8B
from layer5_parallel.runtime.random_source import random_net

GEMV = importlib.import_module("layer1_kernels.gemv")  # (the package's `gemv` is the function)

T0 = time.perf_counter()
SHAPES = {"1b": l3.LLAMA_3_2_1B, "8b": LLAMA_3_8B}  # (planner's 8B: Llama-3.1-8B's shape)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512)
CONTEXT, PAGE = 192, 16  # step rows: each sequence's length (the engine rows' 128 + 64)
PROMPT_LEN, NEW_TOKENS = 128, 64


def log(*a) -> None:
    print(f"[backend-sweep +{time.perf_counter() - T0:6.1f} s]", *a, flush=True)


def use(net: l3.LlamaModel, variant: str) -> None:
    """Set the net's kernels: "torch", "triton" (as the backend comes), "triton-general" (no
    fused decode), "triton-fused" (the fused path at up to layer 1's gemv.MAX_ROWS tokens,
    whatever backends.FUSED_DECODE_MAX_TOKENS says) or "triton-nopdl" (the backend as it
    comes, without programmatic dependent launch)."""
    net.set_backend("torch" if variant == "torch" else "triton")
    l3.comm.kernels.set_decode_pdl(variant != "triton-nopdl")
    if variant == "triton-general":
        net.ops = dataclasses.replace(net.ops, decode=None)
    elif variant == "triton-fused" and net.ops.decode is not None:
        net.ops = dataclasses.replace(net.ops, decode=dataclasses.replace(
            net.ops.decode, max_tokens=GEMV.MAX_ROWS))


# ---- step: one decode step replayed from a CUDA graph ---------------------------------------
class StepBench:
    """A paged cache for the largest batch (K/V random, each sequence's blocks shuffled across
    it), shared by every (variant, batch): a step of B sequences uses the first B tables."""

    def __init__(self, net: l3.LlamaModel, max_batch: int, context: int, gpu: bool) -> None:
        self.net, self.context, self.gpu = net, context, gpu
        self.per_seq = -(-(context + 1) // PAGE)
        blocks = max_batch * self.per_seq
        self.cache = PagedKVCache.for_model(net.config, blocks, PAGE, dtype=net.dtype,
                                            device=net.device)
        gen = torch.Generator(device=net.device).manual_seed(1)
        for pool in (self.cache.k, self.cache.v):
            pool.normal_(0.0, 1.0, generator=gen)
        self.tables = torch.randperm(blocks, generator=gen, device=net.device).view(
            max_batch, self.per_seq)
        self.ids = torch.randint(0, net.config.vocab_size, (max_batch,), generator=gen,
                                 device=net.device)
        self.bytes_weights = L3B.weight_bytes_read(net)
        self.bytes_kv_pos = L3B.kv_bytes_per_position(net)

    def runner(self, B: int) -> CudaGraphRunner:
        r = CudaGraphRunner(self.net, self.cache, B, self.per_seq, capture=False)
        r.input_ids[:B] = self.ids[:B]
        r.positions[:B] = self.context - 1
        r.seq_lens[:B] = self.context
        r.block_tables[:B] = self.tables[:B]
        return r

    @torch.no_grad()
    def seconds(self, B: int) -> tuple[float, torch.Tensor]:
        """Seconds per step (GPU: graph replays between events, the better of two rounds;
        CPU: eager, wall clock) and the step's logits (B, V)."""
        r = self.runner(B)
        if not self.gpu:
            r._step(B)
            t = time.perf_counter()
            r._step(B)
            return time.perf_counter() - t, r.logits[:B].clone()
        graph, _ = l3.capture_graph(lambda: r._step(B), warmup=2)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        est = max(start.elapsed_time(end) / 1e3, 1e-5)
        n = int(min(40, max(5, 0.25 / est)))
        best = float("inf")
        for _ in range(2):
            start.record()
            for _ in range(n):
                graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / n)
        logits = r.logits[:B].clone()
        del graph
        return best, logits

    def profile(self, B: int, top: int = 12) -> list[dict]:
        """The top kernels (GPU time) of 3 replays of the step's graph."""
        from torch.profiler import ProfilerActivity, profile
        r = self.runner(B)
        graph, _ = l3.capture_graph(lambda: r._step(B), warmup=2)
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
        rows = []
        for e in prof.key_averages():
            us = getattr(e, "device_time_total", None)
            if us is None:
                us = getattr(e, "cuda_time_total", 0.0)
            if us:
                rows.append({"kernel": e.key[:110], "calls_per_step": e.count / 3,
                             "us_per_step": us / 3})
        rows.sort(key=lambda x: -x["us_per_step"])
        del graph
        return rows[:top]


# ---- engine: LLM.generate ------------------------------------------------------------------
def _generate(llm, prompts, n: int, gpu: bool) -> tuple[float, list[list[int]]]:
    params = l3.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    if gpu:
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    if gpu:
        torch.cuda.synchronize()
    return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]


class EngineBench:
    """One LLM per variant over the same net (the graphs of each captured with its variant's
    kernels; eager steps run the kernels set on the net, so `use` comes before each run)."""

    def __init__(self, net, variants: list[str], batches: list[int], gpu: bool,
                 new_tokens: int = NEW_TOKENS) -> None:
        self.net, self.gpu, self.new_tokens = net, gpu, new_tokens
        big = max(batches)
        g = torch.Generator().manual_seed(0)
        self.prompts = [torch.randint(0, net.config.vocab_size, (PROMPT_LEN,),
                                      generator=g).tolist() for _ in range(big)]
        longest = PROMPT_LEN + new_tokens + 16
        self.llms, self.counts = {}, {}
        for variant in variants:
            use(net, variant)
            t = time.perf_counter()
            llm = LLM(l3.Model(net, None), cuda_graph=gpu, block_size=PAGE, max_num_seqs=big,
                      num_blocks=big * -(-longest // PAGE) + 16, max_model_len=longest,
                      enable_prefix_caching=False)
            self.llms[variant] = llm
            self.counts[variant] = self._count_graph_steps(llm)
            _generate(llm, self.prompts[:2], 4, gpu)  # warm-up
            log(f"engine {variant}: up and warm in {time.perf_counter() - t:.1f} s (graphs for "
                f"{len(llm.runner.graph.buckets) if llm.runner.graph else 0} buckets)")

    @staticmethod
    def _count_graph_steps(llm) -> dict:
        counts = {"graph": 0}
        graph = llm.runner.graph
        if graph is not None:
            inner = graph.run

            def counted(*a, **kw):
                counts["graph"] += 1
                return inner(*a, **kw)
            graph.run = counted
        return counts

    def row(self, variant: str, B: int, repeats: int = 2) -> dict:
        """Decode tok/s of `B` prompts: B * (n - 1) / (t(n tokens) - t(1 token)), the better
        of `repeats`; graph_steps: the decode steps the graphs ran (of `steps`)."""
        use(self.net, variant)
        llm, n, best = self.llms[variant], self.new_tokens, None
        for _ in range(repeats):
            t1, _ = _generate(llm, self.prompts[:B], 1, self.gpu)
            self.counts[variant]["graph"] = 0
            tn, _ = _generate(llm, self.prompts[:B], n, self.gpu)
            decode_s = tn - t1
            tok_s = B * (n - 1) / decode_s if decode_s > 0 else float("nan")
            row = {"part": "engine", "variant": variant, "batch": B, "tokens_per_s": tok_s,
                   "step_ms": 1e3 * decode_s / (n - 1), "steps": llm.stats.steps,
                   "graph_steps": self.counts[variant]["graph"], "t1_s": t1, "tn_s": tn}
            if best is None or not best["tokens_per_s"] >= tok_s:
                best = row
        return best

    def close(self) -> None:
        for llm in self.llms.values():
            llm.close()
        self.llms.clear()
        gc.collect()
        if self.gpu:
            torch.cuda.empty_cache()


# ---- the run -------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--batches", default="1,8,32,128,256")
    ap.add_argument("--general-batches", default="1,2,4,8",
                    help="batches where the triton backend is also timed without fused decode")
    ap.add_argument("--engine-batches", default="32,256,1,8,128",
                    help="LLM.generate rows, in this order (the budget may cut the last); '' none")
    ap.add_argument("--variants", default="torch,triton")
    ap.add_argument("--extra", default="triton-nopdl:1,triton-nopdl:32",
                    help="more step rows, VARIANT:BATCH,...")
    ap.add_argument("--profile-batch", type=int, default=32, help="0: no profile")
    ap.add_argument("--context", type=int, default=CONTEXT)
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--smoke", action="store_true", help="tiny model, fp32, CPU, eager")
    ap.add_argument("--table-from", type=Path, default=None,
                    help="print the table of an earlier run's JSON (nothing measured)")
    args = ap.parse_args(argv)
    if args.table_from is not None:
        try:
            result = json.loads(args.table_from.read_text())
        except (OSError, ValueError) as err:  # missing, unreadable, empty or cut short
            ap.error(f"--table-from {args.table_from}: not a backend_sweep JSON "
                     f"({type(err).__name__}: {err})")
        print("\n".join(table(result)))
        return result
    gpu = not args.smoke and torch.cuda.is_available()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    batches, general = ints(args.batches), ints(args.general_batches)
    eng_batches = ints(args.engine_batches)
    variants = args.variants.split(",")
    extra = [int(x.split(":")[1]) for x in args.extra.split(",") if x]
    if not batches + general + extra:  # (the step cache is sized for their largest)
        ap.error("no step rows to measure: --batches, --general-batches and --extra are empty")
    shape = dict(SHAPES[args.shape])
    if args.smoke:
        shape.update(TINY)
    config = l3.ModelConfig.from_dict(shape)
    dev, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    net = random_net(config, dtype=dtype, device=dev)  # drawn on the device: seconds, not minutes
    bw = None
    if gpu:
        torch.cuda.synchronize()
        try:
            bw = l3.load_ceilings("cuda").memory_bandwidth
        except Exception as err:  # noqa: BLE001  (MBU is then left out, said so)
            log("no copy bandwidth:", type(err).__name__, str(err)[:120])
    result = {"shape": args.shape, "config": shape, "context": args.context,
              "device": torch.cuda.get_device_name() if gpu else "cpu (smoke)",
              "torch": torch.__version__, "copy_bandwidth": bw,
              "fused_decode_max_tokens": l3.backends.FUSED_DECODE_MAX_TOKENS,
              "rows": [], "profiles": {}, "skipped": []}
    log(f"{args.shape}: {sum(p.numel() for p in net.parameters()) / 1e9:.2f} B parameters "
        f"drawn on {dev}; device {result['device']}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"backend_sweep_{args.shape}.json"

    def budget_left() -> float:
        return args.budget_s - (time.perf_counter() - T0)

    def emit(row: dict) -> None:
        result["rows"].append(row)
        path.write_text(json.dumps(result, indent=1, default=str))
        extra = (f" MBU {row['MBU']:.0%}" if row.get("MBU") else "") + (
            f" graph steps {row['graph_steps']}/{row['steps']}" if "graph_steps" in row else "") + (
            f" prefill+1 {row['t1_s']:.3f} s" if "t1_s" in row else "")
        log(f"{args.shape} {row['part']:6} {row['variant']:14} batch {row['batch']:>3}: "
            f"{row['tokens_per_s']:10,.1f} tok/s  step {row['step_ms']:8.3f} ms{extra}")

    with torch.no_grad():
        bench = StepBench(net, max(batches + general + extra), args.context, gpu)
        log(f"paged cache: {bench.cache.k.numel() * 2 * bench.cache.k.element_size() / 2**30:.2f}"
            f" GiB, {bench.per_seq} blocks a sequence")
        plan = [(v, B) for B in batches for v in variants]
        plan += [(v, B) for B in general if "triton" in variants
                 for v in ("triton-fused", "triton-general")]
        plan += [(v, int(B)) for v, B in (x.split(":") for x in args.extra.split(",") if x)]
        logits = {}
        for variant, B in plan:
            if budget_left() <= 0:
                result["skipped"].append(f"step {variant} {B}")
                log(f"step {variant} batch {B}: skipped (budget spent)")
                continue
            use(net, variant)
            s, out = bench.seconds(B)
            kv = bench.bytes_kv_pos * B * args.context
            row = {"part": "step", "variant": variant, "batch": B, "tokens_per_s": B / s,
                   "step_ms": s * 1e3,
                   "MBU": (bench.bytes_weights + kv) / s / bw if bw else None}
            ref = logits.setdefault(B, out)  # the first variant's logits: the others agree?
            row["argmax_agree"] = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
            row["max_abs_logit_diff"] = float((out - ref).abs().max())
            emit(row)
        del bench
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
        engines = EngineBench(net, variants, eng_batches, gpu) if eng_batches else None
        try:
            for B in eng_batches:  # the variants side by side at each batch
                for variant in variants:
                    if budget_left() <= 0:
                        result["skipped"].append(f"engine {variant} {B}")
                        log(f"engine {variant} batch {B}: skipped (budget spent)")
                        continue
                    emit(engines.row(variant, B))
        finally:
            if engines is not None:
                engines.close()
        if gpu and args.profile_batch and budget_left() > 0:  # last: a profiler hang costs only it
            bench = StepBench(net, args.profile_batch, args.context, gpu)
            for variant in variants:
                use(net, variant)
                try:
                    result["profiles"][variant] = bench.profile(args.profile_batch)
                except Exception as err:  # noqa: BLE001  (a profiler failure costs only this)
                    result["profiles"][variant] = [{"error": f"{type(err).__name__}: {err}"}]
                path.write_text(json.dumps(result, indent=1, default=str))
                log(f"profile {variant} batch {args.profile_batch}:")
                for k in result["profiles"][variant][:8]:
                    us, n = k.get("us_per_step", 0), k.get("calls_per_step", 0)
                    print(f"    {us:9.1f} us  x{n:5.1f}  {k.get('kernel', k.get('error'))}",
                          flush=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    log("table:")
    for line in table(result):
        print(line, flush=True)
    return result


def table(result: dict) -> list[str]:
    """triton / torch per (part, batch), and the fused-vs-general rows."""
    by = {(r["part"], r["variant"], r["batch"]): r for r in result["rows"]}
    lines = [f"{result['shape']} on {result['device']}: tok/s, triton / torch "
             f"(step: graph replay, context {result['context']}; engine: LLM.generate)"]
    for part in ("step", "engine"):
        for B in sorted({r["batch"] for r in result["rows"] if r["part"] == part}):
            t, c = by.get((part, "torch", B)), by.get((part, "triton", B))
            g, fu = by.get((part, "triton-general", B)), by.get((part, "triton-fused", B))
            f = lambda r: f"{r['tokens_per_s']:10,.1f}" if r else f"{'-':>10}"  # noqa: E731
            ratio = f"{c['tokens_per_s'] / t['tokens_per_s']:.2f}x" if t and c else "-"
            fused = (f"  fused {f(fu)} general {f(g)} fused/general "
                     f"{fu['tokens_per_s'] / g['tokens_per_s']:.2f}x" if fu and g else "")
            prefill = (f"  prefill+1 s: torch {t['t1_s']:.3f} triton {c['t1_s']:.3f}"
                       if t and c and "t1_s" in t and "t1_s" in c else "")
            lines.append(f"  {part:6} B={B:<3} torch {f(t)}  triton {f(c)}  {ratio:>6}{fused}"
                         f"{prefill}")
    known = ("torch", "triton", "triton-fused", "triton-general")
    for r in result["rows"]:
        if r["variant"] not in known:
            c = by.get((r["part"], "triton", r["batch"]))
            vs = f" ({r['tokens_per_s'] / c['tokens_per_s']:.2f}x triton)" if c else ""
            lines.append(f"  {r['part']:6} B={r['batch']:<3} {r['variant']} "
                         f"{r['tokens_per_s']:,.1f} tok/s{vs}")
    lines.append(f"  fused path up to {result['fused_decode_max_tokens']} tokens now; "
                 f"not slower than the general path up to: {fused_limit(result)}")
    return lines


def fused_limit(result: dict, tolerance: float = 0.01) -> int | None:
    """The largest measured batch B such that at every measured batch <= B the fused step
    ("triton-fused") was within `tolerance` of the general
    path's time or faster (None: no fused-vs-general rows)."""
    rows = {(r["variant"], r["batch"]): r["step_ms"] for r in result["rows"]
            if r["part"] == "step"}
    pairs = sorted(B for v, B in rows if v == "triton-general" and ("triton-fused", B) in rows)
    best = None
    for B in pairs:
        if rows[("triton-fused", B)] > rows[("triton-general", B)] * (1 + tolerance):
            break
        best = B
    return best


if __name__ == "__main__":
    main()
