"""Structured outputs: the cost of the grammar mask, same run, same engine.

    python benchmarks/structured_bench.py --device cuda --out DIR      # the GPU run
    python benchmarks/structured_bench.py --device cpu --quick         # a smoke run here

Rows:
* decode throughput at batch B (default 32): B prompts, N new tokens each, every row under a
  json_schema constraint that cannot finish within N tokens (an array of >= 64 objects), so
  every step masks every row; against the same requests unconstrained, both with the engine's
  default scheduling (async on a GPU; a constrained request steps synchronously) and both
  synchronous (the mask's own cost). Generated tokens per wall second, each the best of
  --repeats runs after an untimed warm-up.
* the mask alone per step at batch B: llguidance filling B bitmask rows on the host
  (fill_masks) and applying them to (B, V) logits on the device.
* grammar compile time per schema (tests/layer4/schemas.py: nested objects, arrays, enums,
  bounded numbers, anyOf, patterns): a fresh compiler's first compile, then the cached
  second request (a cache hit + a copy of the compiled matcher).
The model is the course model unless --model names another with a tokenizer.
"""
from __future__ import annotations

import argparse
import json
import platform
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
from tests.layer4.schemas import SCHEMAS  # noqa: E402

LONG = {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}}


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def throughput(model: l3.Model, batch: int, new: int, constrained: bool, repeats: int,
               **engine) -> dict:
    llm = l4.LLM(model, max_num_seqs=batch, **engine)
    spec = l4.StructuredOutputsParams(json=LONG) if constrained else None
    params = [l4.SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True,
                                structured_outputs=spec) for _ in range(batch)]
    prompts = [f"{name}.\n" for name in ("HAMLET", "OPHELIA", "HORATIO", "LAERTES")] * (
        -(-batch // 4))
    llm.generate(prompts[:batch], params)  # warm-up: graphs, grammar compile, allocator
    best = 0.0
    for _ in range(repeats):
        t0 = _sync(llm.model.net.device)
        outs = llm.generate(prompts[:batch], params)
        dt = _sync(llm.model.net.device) - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        best = max(best, tokens / dt)
    valid_prefix = all(o.outputs[0].text.startswith("[{") for o in outs) if constrained else None
    return {"batch": batch, "new_tokens": new, "constrained": constrained,
            "async_scheduling": llm.config.async_scheduling, "tokens_per_s": round(best, 1),
            "json_prefix_ok": valid_prefix}


def mask_cost(model: l3.Model, batch: int, steps: int = 50) -> dict:
    """Host fill of B rows and the device apply, per step, at B rows mid-document."""
    compiler = l4.GrammarCompiler.for_model(model)
    states = [compiler.state(l4.StructuredOutputsParams(json=LONG)) for _ in range(batch)]
    tok = model.tokenizer
    prefix = tok.encode('[{"name":"Yorick","age":3,"tags":["red"]},{"name":"',
                        add_special_tokens=False)
    for s in states:
        for t in prefix:
            s.accept(t)
    V, device = model.config.vocab_size, model.net.device
    logits = torch.randn(batch, V, device=device)
    bitmask = l4.structured.allocate(batch, V, pin=device.type == "cuda")
    fill, apply = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        l4.structured.fill_masks(states, bitmask)
        t1 = _sync(device)
        l4.apply_token_bitmask_(logits, bitmask)
        t2 = _sync(device)
        fill.append(t1 - t0)
        apply.append(t2 - t1)
    return {"batch": batch, "vocab": V, "fill_us": round(1e6 * statistics.median(fill), 1),
            "apply_us": round(1e6 * statistics.median(apply), 1)}


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
    return {"schemas": len(SCHEMAS), "vocabulary_ms": round(vocab_ms, 2),
            "first_ms_median": round(1e3 * statistics.median(first), 3),
            "first_ms_max": max(ms), "cached_ms_median": round(1e3 * statistics.median(second), 3),
            "cached_ms_max": round(1e3 * max(second), 3), "first_ms_per_schema": ms,
            "stats": compiler.stats}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="course")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small sizes (a CPU smoke run)")
    ap.add_argument("--out", type=Path, default=None, help="folder for structured_bench.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.new_tokens, args.repeats = 4, 24, 1
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    path = l3.course_model_dir("target") if args.model == "course" else args.model
    model = l3.load(path, device=args.device, dtype=dtype)
    if model.tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer: a grammar needs one")
    torch.set_grad_enabled(False)
    rows = {"compile": compile_times(model), "mask": mask_cost(model, args.batch)}
    tp = []
    for sync in (None, False):  # the engine's default scheduling, then synchronous both
        engine = {} if sync is None else {"async_scheduling": False}
        free = throughput(model, args.batch, args.new_tokens, False, args.repeats, **engine)
        tight = throughput(model, args.batch, args.new_tokens, True, args.repeats, **engine)
        tp.append({"scheduling": "default" if sync is None else "sync", "unconstrained": free,
                   "json_schema": tight,
                   "ratio": round(tight["tokens_per_s"] / free["tokens_per_s"], 3)})
    rows["throughput"] = tp
    rows["env"] = {"device": torch.cuda.get_device_name() if args.device == "cuda" else
                   platform.processor() or "cpu", "torch": torch.__version__,
                   "model": args.model, "dtype": dtype,
                   "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    c, m = rows["compile"], rows["mask"]
    print(f"compile: {c['schemas']} schemas, first {c['first_ms_median']} ms median "
          f"(max {c['first_ms_max']}), cached {c['cached_ms_median']} ms")
    print(f"mask at batch {m['batch']}, V={m['vocab']}: fill {m['fill_us']} us (host), "
          f"apply {m['apply_us']} us (device)")
    for r in tp:
        print(f"{r['scheduling']:>8}: unconstrained {r['unconstrained']['tokens_per_s']} tok/s, "
              f"json_schema {r['json_schema']['tokens_per_s']} tok/s -> {r['ratio']}x")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "structured_bench.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
