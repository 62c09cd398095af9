"""Structured outputs: the cost of the grammar mask, same run, same engine.

    python benchmarks/structured_bench.py --device cuda --out DIR      # the GPU run
    python benchmarks/structured_bench.py --device cpu --quick         # a smoke run here

Parts, in this order, each printed (flushed) as it ends, the whole bounded by --time-limit:
* compile: grammar compile time per schema (tests/layer4/schemas.py: nested objects, arrays,
  enums, bounded numbers, anyOf, patterns): a fresh compiler's first compile, then the
  cached second request (a cache hit + a copy of the compiled matcher).
* mask: the mask alone per step at batch B, B rows mid-document: the host fill (one by one
  on this thread), the fill of B rows spread over a document (keys, numbers, enums, strings)
  on 1, 2, 4 and the engine's default number of fill threads (llguidance's pool, the rows'
  grammar in as many lanes: layer4_algorithms/structured/mask_fill.py), then the apply:
  `TokenMasks.apply` as the engine calls it (fill + one copy + one kernel launch: host time,
  then the time until the device is done), the Triton kernel alone and the torch reference
  on device-resident inputs.
* throughput at batch B (default 32): B prompts, N new tokens each, every row under a
  json_schema constraint that cannot finish within N tokens (an array of >= 64 objects), so
  every step masks every row; against the same requests unconstrained, with the engine's
  default scheduling (async on a GPU, constrained rows included; forced on on a CPU, whose
  default is synchronous) and both synchronous; on CUDA both again with the decode steps
  replayed from CUDA graphs (cuda_graph=True).
  Generated tokens per wall second, each the best of --repeats runs after an untimed
  warm-up, a mode's variants run in turn (round robin) so a slow spell hits them alike;
  with the engine's own per-step mask figures (host fill, host apply) and its step count,
  and the wall time per step. json_schema is the engine's way (the fill on its default fill
  threads; under CUDA graphs the apply, and for a greedy step the masked argmax, replayed
  from a CUDA graph); beside it, on a host with >= 8 CPUs, the other way of filling:
  one_thread (one row at a time on the engine's thread) where the default is the pool, else
  pool (llguidance's pool over lanes); under CUDA graphs plain_apply (the apply launched
  plainly): to show what each gives.
* --shape llama-3.2-1b (CUDA): the same async CUDA-graph comparison on random weights of
  that model's shape (vocabulary 128,256: the mask is 4,008 words a row) with the course
  tokenizer (so the grammar's fill walks the course vocabulary's 4,096 tokens, not a
  128k one), where the GPU's step is longer.
The model is the course model unless --model names another with a tokenizer.
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import platform
import signal
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.layer4.schemas

import layer3_model as l3  # noqa: E402
import layer4_algorithms as l4  # noqa: E402
from layer0_hardware import timed_into  # noqa: E402
from tests.layer4.schemas import SCHEMAS  # noqa: E402

LONG = {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}}
T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", flush=True)


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Throughput:
    """One engine at batch B under one variant: B prompts, `new` tokens each (ignore_eos),
    greedy, every row under LONG when constrained. `run()` times one generate(); the row keeps
    the best run (runs of a mode's variants are interleaved by the caller, so a slow spell of
    a shared host does not land on one variant only). graphs: None for the engine's own
    choice, else whether the apply replays from CUDA graphs."""

    def __init__(self, model: l3.Model, batch: int, new: int, constrained: bool,
                 graphs: bool | None = None, **engine) -> None:
        blocks = batch * (-(-(new + 16) // 16) + 1) + 16  # every sequence's KV, no more
        self.llm = l4.LLM(model, max_num_seqs=batch, num_blocks=blocks, **engine)
        if graphs is not None and self.llm.masks.cuda:
            self.llm.masks.graphs = l4.structured.mask_graph.MaskGraphs() if graphs else None
        spec = l4.StructuredOutputsParams(json=LONG) if constrained else None
        self.params = [l4.SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True,
                                         structured_outputs=spec) for _ in range(batch)]
        self.prompts = ([f"{name}.\n" for name in ("HAMLET", "OPHELIA", "HORATIO", "LAERTES")]
                        * (-(-batch // 4)))[:batch]
        # the engine's thread appending tokens, over a run
        self.complete_s = 0.0
        self.llm._complete = timed_into(self.llm._complete, self._add_complete)
        self.llm.generate(self.prompts, self.params)  # warm-up: graphs, compile, allocator
        self.row = {"batch": batch, "new_tokens": new, "constrained": constrained,
                    "async_scheduling": self.llm.config.async_scheduling,
                    "apply_graphs": self.llm.masks.graphs is not None,
                    "fill_threads": self.llm.masks.fill_threads,
                    "tokens_per_s": 0.0, "runs": []}

    def _add_complete(self, seconds: float) -> None:
        self.complete_s += seconds

    def run(self) -> None:
        llm, row = self.llm, self.row
        before = dict(llm.masks.stats)
        self.complete_s = 0.0
        t0 = _sync(llm.model.net.device)
        outs = llm.generate(self.prompts, self.params)
        dt = _sync(llm.model.net.device) - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        row["runs"].append(round(tokens / dt, 1))
        if tokens / dt <= row["tokens_per_s"]:
            return
        steps = llm.stats.steps
        masks = {k: llm.masks.stats[k] - before[k] for k in before}
        row.update(tokens_per_s=round(tokens / dt, 1), steps=steps,
                   append_us_per_step=round(1e6 * self.complete_s / max(1, steps), 1),
                   wall_ms_per_step=round(1e3 * dt / max(1, steps), 3))
        if row["constrained"]:
            row["json_prefix_ok"] = all(o.outputs[0].text.startswith("[{") for o in outs)
        if llm.masks.graphs is not None:
            row["mask_graphs"] = dict(llm.masks.graphs.stats, failed=llm.masks.graphs.failed)
        if masks.get("steps"):
            n = masks["steps"]
            row.update(masked_steps=n,
                       engine_fill_us_per_step=round(1e6 * masks["fill_s"] / n, 1),
                       engine_apply_us_per_step=round(1e6 * masks["apply_s"] / n, 1))


def mid_document(model: l3.Model, batch: int) -> tuple[list, l4.GrammarCompiler]:
    compiler = l4.GrammarCompiler.for_model(model)
    states = [compiler.state(l4.StructuredOutputsParams(json=LONG)) for _ in range(batch)]
    prefix = model.tokenizer.encode('[{"name":"Yorick","age":3,"tags":["red"]},{"name":"',
                                    add_special_tokens=False)
    for s in states:
        for t in prefix:
            s.accept(t)
    return states, compiler


DOC = ('[{"name":"Yorick","age":3,"tags":["red","blue"]},{"name":"Ophelia","age":17,'
       '"tags":[]},{"name":"Horatio","age":30,"tags":["green"]},{"name":"Osric","age":2')


def spread_states(model: l3.Model, batch: int, lanes: int) -> list:
    """batch states of LONG at different places of one document (row i after its first
    ~i * 40 / batch tokens): keys, numbers, enums and strings, as a real batch is."""
    compiler = l4.GrammarCompiler.for_model(model, lanes=lanes)
    doc = model.tokenizer.encode(DOC, add_special_tokens=False)
    states = [compiler.state(l4.StructuredOutputsParams(json=LONG)) for _ in range(batch)]
    for i, s in enumerate(states):
        for t in doc[:i * (len(doc) - 1) // max(1, batch - 1)]:
            assert s.accept(t)
    return states


def _median_us(fn, steps: int, device: torch.device) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(_sync(device) - t0)
    return round(1e6 * statistics.median(times), 1)


def _host_us(fn, steps: int, device: torch.device) -> float:
    """Median host time of fn (its device work waited for after each call, untimed)."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        _sync(device)
    return round(1e6 * statistics.median(times), 1)


def mask_cost(model: l3.Model, batch: int, steps: int = 50) -> dict:
    """Host fill of B rows and the apply, per step, B rows mid-document."""
    states, _ = mid_document(model, batch)
    V, device = model.config.vocab_size, model.net.device
    bitmask = l4.structured.allocate(batch, V, pin=device.type == "cuda")
    fill_us = _median_us(lambda: l4.structured.fill_masks(states, bitmask), steps,
                         torch.device("cpu"))
    say(f"mask fill at batch {batch}, V={V}: {fill_us} us a step on this thread (warm: the "
        f"same states again and again)")
    # rows spread over a document: one thread, then llguidance's pool over lanes of LONG
    lanes = l4.structured.host_lanes()
    spread = {}
    for n in sorted({1, 2, 4, lanes}):
        states = spread_states(model, batch, n)
        pool = l4.structured.grammar.llg().LLExecutor(n) if n > 1 else None
        l4.structured.fill_masks(states, bitmask, pool)  # (the lanes' first visits)
        spread[n] = _median_us(lambda st=states, p=pool: l4.structured.fill_masks(st, bitmask, p),
                               steps, torch.device("cpu"))
    say(f"mask fill at batch {batch}, rows spread over a document: {spread} us a step by fill "
        f"threads (= lanes; this host's share: {lanes}, the engine's default: "
        f"{l4.structured.default_lanes(device.type)})")

    class Row:
        def __init__(self, g):
            self.grammar = g

    seqs = [Row(s) for s in states]
    logits = torch.randn(batch, V, device=device)
    masks = l4.structured.TokenMasks(V, device, rows=batch)
    host_us, done_us = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        masks.apply(logits, seqs)
        t1 = time.perf_counter()
        t2 = _sync(device)
        host_us.append(1e6 * (t1 - t0))
        done_us.append(1e6 * (t2 - t0))
    dev_bitmask = bitmask.to(device)
    rows = torch.arange(batch, device=device)
    apply = {"engine_apply_host_us": round(statistics.median(host_us), 1),
             "engine_apply_done_us": round(statistics.median(done_us), 1)}
    # TokenMasks' parts, host time only (each call's device work waited for outside the
    # timing): the fill on this thread and the launch (one copy + one event + one kernel;
    # then replayed from a CUDA graph, as under CUDA-graph decoding), then the copy and the
    # kernel alone
    apply["engine_prepare_host_us"] = _host_us(lambda: masks.prepare(seqs), steps, device)
    prepared = masks.prepare(seqs)
    apply["engine_launch_host_us"] = _host_us(lambda: masks.launch(logits, prepared), steps,
                                              device)
    if device.type == "cuda":
        masks.graphs = l4.structured.mask_graph.MaskGraphs()
        apply["engine_launch_graph_host_us"] = _host_us(lambda: masks.launch(logits, prepared),
                                                        steps, device)
        apply["graphs"] = dict(masks.graphs.stats, failed=masks.graphs.failed)
    if device.type == "cuda":
        from layer4_algorithms.structured.mask_kernel import apply_bitmask_triton

        R, n, _, host, dev = prepared
        W = masks.W
        apply["copy_host_us"] = _host_us(
            lambda: dev[:n].copy_(host[:n], non_blocking=True), steps, device)
        apply["kernel_launch_host_us"] = _host_us(
            lambda: apply_bitmask_triton(logits, dev[:R * W].view(R, W), dev[R * W:n]), steps,
            device)
    for impl in ("triton", "torch") if device.type == "cuda" else ("torch",):
        # (on a CPU the kernel would run in Triton's interpreter: its time says nothing)
        apply[f"{impl}_us"] = _median_us(
            lambda impl=impl: l4.apply_token_bitmask_(logits, dev_bitmask, rows, impl=impl),
            steps, device)
    if device.type == "cuda":
        from triton.testing import do_bench

        for impl in ("triton", "torch"):
            apply[f"{impl}_device_us"] = round(1e3 * do_bench(
                lambda impl=impl: l4.apply_token_bitmask_(logits, dev_bitmask, rows,
                                                          impl=impl)), 1)
    say(f"mask apply at batch {batch}: {apply}")
    return {"batch": batch, "vocab": V, "fill_us": fill_us, "fill_spread_us_by_threads": spread,
            "host_fill_threads": lanes,
            "default_fill_threads": l4.structured.default_lanes(device.type), **apply}


def compile_times(model: l3.Model) -> dict:
    compiler = l4.GrammarCompiler.for_model(model)
    t0 = time.perf_counter()
    _ = compiler.tokenizer  # the vocabulary's one-time cost, reported apart
    vocab_ms = 1e3 * (time.perf_counter() - t0)
    first, second = [], []
    for schema in SCHEMAS:
        spec = l4.StructuredOutputsParams(json=schema)
        t0 = time.perf_counter()
        _ = compiler.state(spec).matcher  # check + compile + copy, waited for
        first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _ = compiler.state(spec).matcher
        second.append(time.perf_counter() - t0)
    ms = [round(1e3 * x, 3) for x in first]
    out = {"schemas": len(SCHEMAS), "vocabulary_ms": round(vocab_ms, 2),
           "first_ms_median": round(1e3 * statistics.median(first), 3),
           "first_ms_max": max(ms), "cached_ms_median": round(1e3 * statistics.median(second), 3),
           "cached_ms_max": round(1e3 * max(second), 3), "first_ms_per_schema": ms,
           "cached_ms_per_schema": [round(1e3 * x, 4) for x in second],
           "stats": compiler.stats}
    compiler.close()
    say(f"compile: {out['schemas']} schemas, first {out['first_ms_median']} ms median "
        f"(max {out['first_ms_max']}), cached {out['cached_ms_median']} ms median "
        f"(max {out['cached_ms_max']}); vocabulary once {out['vocabulary_ms']} ms")
    return out


def others(row: dict) -> str:
    """The other ways' ratios of a mode's row."""
    names = {"one_thread": "fill on one thread", "pool": "fill on the pool",
             "plain_apply": "apply launched plainly"}
    got = [f"{text} {row[f'ratio_{v}']}x" for v, text in names.items() if f"ratio_{v}" in row]
    return ", ".join(got) or "no other way"


def shape_model(shape: str, device: str, quick: bool) -> l3.Model:
    """Random weights of a real model's shape (bf16 on a GPU, drawn there) with the course
    tokenizer, its EOS as the config's; quick: 2 layers of a narrow width, the real
    vocabulary (a CPU smoke run)."""
    from layer5_parallel.runtime.random_source import random_net

    tok = l3.Tokenizer.from_pretrained(l3.course_model_dir("target"))
    cfg = dict(l3.LLAMA_3_2_1B if shape == "llama-3.2-1b" else {})
    if not cfg:
        raise SystemExit(f"--shape {shape!r}: only llama-3.2-1b")
    eos = tok.eos_token_ids[0]
    cfg.update(eos_token_id=eos, bos_token_id=eos)
    if quick:
        cfg.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    net = random_net(l3.ModelConfig.from_dict(cfg), dtype=dtype, device=device)
    return l3.Model(net, tok)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="course")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=100.0,
                    help="seconds: throughput configs that would start later are skipped, "
                         "and the process dumps its stacks and exits at this + 60")
    ap.add_argument("--quick", action="store_true", help="small sizes (a CPU smoke run)")
    ap.add_argument("--shape", default="",
                    help="also async CUDA graphs on random weights of this shape "
                         "(llama-3.2-1b) with the course tokenizer")
    ap.add_argument("--out", type=Path, default=None, help="folder for structured_bench.json")
    args = ap.parse_args(argv)
    faulthandler.dump_traceback_later(args.time_limit + 60, exit=True)
    faulthandler.register(signal.SIGTERM, chain=True)  # killed by a caller's limit: say where
    if args.quick:
        args.batch, args.new_tokens, args.repeats = 4, 24, 1
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    path = l3.course_model_dir("target") if args.model == "course" else args.model
    say(f"loading {args.model} on {args.device} ({dtype})")
    model = l3.load(path, device=args.device, dtype=dtype)
    if model.tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer: a grammar needs one")
    torch.set_grad_enabled(False)
    rows: dict = {"env": {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else
        platform.processor() or "cpu", "cpus": os.cpu_count(), "torch": torch.__version__,
        "model": args.model, "dtype": dtype, "batch": args.batch,
        "new_tokens": args.new_tokens, "repeats": args.repeats,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}}

    def save() -> None:
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "structured_bench.json").write_text(json.dumps(rows, indent=1))

    rows["compile"] = compile_times(model)
    save()
    rows["mask"] = mask_cost(model, args.batch)
    save()
    tp, skipped = [], []
    sync = {"async_scheduling": False}
    graph = {"cuda_graph": True}
    # on a CPU the engine's default is synchronous: async is forced on to run its path
    modes = [("async", model, {"async_scheduling": True}), ("sync", model, sync)]
    if args.device == "cuda":  # and with the decode steps replayed from CUDA graphs
        modes = [("graph", model, graph), ("default", model, {}),
                 ("graph-sync", model, {**graph, **sync}), ("sync", model, sync)]
        # (the async CUDA-graph ratio first: the hardest target)
    if args.shape:  # second: after the target's own row, before the other modes
        say(f"random weights of {args.shape}'s shape, the course tokenizer")
        modes.insert(1, (f"{args.shape}-graph" if args.device == "cuda" else args.shape,
                         shape_model(args.shape, args.device, args.quick),
                         graph if args.device == "cuda" else {"async_scheduling": True}))
    for name, m, engine in modes:
        row = {"scheduling": name, "engine": engine}
        variants = [("unconstrained", False, None, {}), ("json_schema", True, None, {})]
        lanes = l4.structured.host_lanes()
        if lanes > 1 and l4.structured.default_lanes(args.device) > 1:  # the other fill way
            variants.append(("json_schema_one_thread", True, None, {"grammar_fill_threads": 1}))
        elif lanes > 1:
            variants.append(("json_schema_pool", True, None, {"grammar_fill_threads": lanes}))
        if engine.get("cuda_graph", False) and args.device == "cuda":  # the apply's graphs
            variants.append(("json_schema_plain_apply", True, False, {}))
        runs = {}
        for key, constrained, apply_graphs, more in variants:
            if time.perf_counter() - T0 > args.time_limit:
                skipped.append(f"{name}/{key}")
                say(f"{name}/{key}: skipped (past --time-limit {args.time_limit} s)")
                continue
            try:  # (a variant that fails is reported, the others go on)
                runs[key] = Throughput(m, args.batch, args.new_tokens, constrained,
                                       apply_graphs, **engine, **more)
            except Exception as e:  # noqa: BLE001
                row[key] = {"error": f"{type(e).__name__}: {e}"}
                say(f"{name}/{key}: FAILED to start: {row[key]['error']}")
        for rep in range(args.repeats):  # interleaved: each variant once per round
            if rep and time.perf_counter() - T0 > args.time_limit:
                say(f"{name}: {rep} of {args.repeats} rounds (past --time-limit)")
                break
            for key, r in list(runs.items()):
                try:
                    r.run()
                except Exception as e:  # noqa: BLE001
                    row[key] = {"error": f"{type(e).__name__}: {e}"}
                    say(f"{name}/{key}: FAILED: {row[key]['error']}")
                    del runs[key]
        for key, t in runs.items():
            r = row[key] = t.row
            extra = (f", fill threads {r['fill_threads']}, apply graphs {r['apply_graphs']} "
                     f"{r.get('mask_graphs', '')}; engine "
                     f"mask fill {r.get('engine_fill_us_per_step')} us + apply "
                     f"{r.get('engine_apply_us_per_step')} us per step, "
                     f"{r.get('masked_steps')} masked steps"
                     if r["constrained"] else "")
            say(f"{name}/{key}: {r['tokens_per_s']} tok/s (runs {r['runs']}, "
                f"async={r['async_scheduling']}, {r['steps']} steps, "
                f"{r['wall_ms_per_step']} ms a step, appending tokens "
                f"{r.get('append_us_per_step')} us a step{extra})")
        del runs
        gc.collect()
        def ok(key: str, row: dict = row) -> bool:  # (a variant that failed has no rate)
            return "tokens_per_s" in row.get(key, {})

        if ok("unconstrained") and ok("json_schema"):
            free = row["unconstrained"]["tokens_per_s"]
            row["ratio"] = round(row["json_schema"]["tokens_per_s"] / free, 3)
            for v in ("one_thread", "pool", "plain_apply"):
                if ok(f"json_schema_{v}"):
                    row[f"ratio_{v}"] = round(row[f"json_schema_{v}"]["tokens_per_s"] / free, 3)
            say(f"{name}: json_schema / unconstrained = {row['ratio']}x ({others(row)}; "
                f"target >= 0.9x)")
        tp.append(row)
        rows["throughput"] = tp
        save()
    rows["skipped"] = skipped
    c, m = rows["compile"], rows["mask"]
    print(f"SUMMARY compile: {c['schemas']} schemas, first {c['first_ms_median']} ms median "
          f"(max {c['first_ms_max']}), cached {c['cached_ms_median']} ms", flush=True)
    print(f"SUMMARY mask at batch {m['batch']}, V={m['vocab']}: fill {m['fill_us']} us (host), "
          f"TokenMasks.apply {m['engine_apply_host_us']} us host / "
          f"{m['engine_apply_done_us']} us to done (fill included); launch "
          f"{m['engine_launch_host_us']} us, from a graph "
          f"{m.get('engine_launch_graph_host_us')} us", flush=True)
    for r in tp:
        if "ratio" in r:
            print(f"SUMMARY {r['scheduling']:>18}: unconstrained "
                  f"{r['unconstrained']['tokens_per_s']} tok/s "
                  f"({r['unconstrained']['wall_ms_per_step']} ms a step), json_schema "
                  f"{r['json_schema']['tokens_per_s']} tok/s -> {r['ratio']}x "
                  f"({others(r)})", flush=True)
    save()
    faulthandler.cancel_dump_traceback_later()
    return rows


if __name__ == "__main__":
    main()
