"""Where a step's mask fill goes, on a CPU: real token streams replayed through fresh grammars.

    python benchmarks/mask_fill_cost.py [--batch 32] [--new-tokens 128] [--distinct]

1. The engine generates --batch rows of --new-tokens tokens (course model, greedy, every row
   under structured_bench's LONG schema, as the GPU benchmark does: 4 prompts repeated unless
   --distinct gives each row its own) and keeps each row's output token ids.
2. Those streams are replayed through fresh grammar states step by step (advance each row by
   its last token, then fill every row's mask), each way of filling timed per step:
   * python   GrammarState.fill, row by row
   * engine   fill_masks on this thread (the serial fill: failed rows apart, then each
              matcher at its row's address)
   * matcher  LLMatcher.unsafe_compute_mask_ptr row by row (llguidance alone, no wrapper)
   * exec1    one call of llguidance's executor, 1 thread, over all rows
   * twice    the same, a second time on unchanged states (what a warm micro-benchmark sees)
   and the advance (accept_at per row). Printed: us per row, each the median over steps
   (and the mean and the worst step). --warm: every replay on one compiler that has replayed
   the streams once before; by default each replay compiles afresh.

What it showed on a 2-core CPU (course model, V = 4,096, 32 rows, 14 distinct streams): the
fill is llguidance's own work, ~6-7 us a row at the median whichever way it is called (the
Python wrapper adds well under 1 us a row; the bitmask is written in place, no copy), ~4.8 us
on a state filled before; but a fresh compile's first visits of lexer states cost ~1 ms a
row in some steps (a mean of 25-35 us a row over 128 steps against 7 us with --warm):
llguidance builds its lexer's automaton lazily and shares it among the copies of one
compiled grammar, so the first requests of a schema pay for what later ones reuse.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from structured_bench import LONG  # noqa: E402

import layer3_model as l3  # noqa: E402
import layer4_algorithms as l4  # noqa: E402


def streams(model, batch: int, new: int, distinct: bool) -> list[list[int]]:
    names = ("HAMLET", "OPHELIA", "HORATIO", "LAERTES")
    prompts = [f"{names[i % 4]}.\n" for i in range(batch)]
    if distinct:
        prompts = [f"{names[i % 4]}.\n{'My lord, ' * (i // 4)}" for i in range(batch)]
    llm = l4.LLM(model, max_num_seqs=batch, num_blocks=batch * (new // 16 + 3) + 16)
    spec = l4.StructuredOutputsParams(json=LONG)
    params = [l4.SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True,
                                structured_outputs=spec) for _ in prompts]
    outs = llm.generate(prompts, params)
    return [list(o.outputs[0].token_ids) for o in outs]


def replay(model, toks: list[list[int]], way: str,
           compiler: l4.GrammarCompiler | None = None) -> tuple[list[float], list[float]]:
    """Per step: (seconds advancing all rows, seconds filling all rows). compiler: one that
    has compiled (and filled) the schema before (warm), else a fresh one."""
    from layer4_algorithms.structured.grammar import llg

    fresh = compiler is None
    compiler = compiler or l4.GrammarCompiler.for_model(model)
    spec = l4.StructuredOutputsParams(json=LONG)
    R = len(toks)
    states = [compiler.state(spec) for _ in range(R)]
    bitmask = l4.structured.allocate(R, model.config.vocab_size)
    rows = bitmask.numpy()
    W = rows.shape[1]
    ex = llg().LLExecutor(1)
    adv, fill = [], []
    for t in range(min(len(x) for x in toks)):
        t0 = time.perf_counter()
        if t:
            for s, x in zip(states, toks, strict=True):
                s.accept_at(x[t - 1], t - 1)
        t1 = time.perf_counter()
        if way == "python":
            for j, s in enumerate(states):
                s.fill(rows[j])
        elif way == "engine":  # the serial fill as TokenMasks.prepare calls it
            l4.structured.fill_masks(states, bitmask)
        elif way == "matcher":
            for j, s in enumerate(states):
                s.matcher.unsafe_compute_mask_ptr(rows[j].ctypes.data, W * 4)
        else:
            pairs = [(s.matcher, j) for j, s in enumerate(states)]
            ex.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), W * 4, R)
            if way == "twice":
                t1 = time.perf_counter()
                ex.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), W * 4, R)
        t2 = time.perf_counter()
        adv.append(t1 - t0 if way != "twice" else 0.0)
        fill.append(t2 - t1)
    if fresh:
        compiler.close()
    return adv, fill


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--distinct", action="store_true", help="a prompt of its own per row")
    ap.add_argument("--ways", default="python,engine,matcher,exec1,twice")
    ap.add_argument("--warm", action="store_true",
                    help="one compiler for every replay, after an untimed replay")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model = l3.load(l3.course_model_dir("target"), device="cpu", dtype="float32")
    t0 = time.perf_counter()
    toks = streams(model, args.batch, args.new_tokens, args.distinct)
    print(f"generated {args.batch} x {args.new_tokens} tokens in "
          f"{time.perf_counter() - t0:.1f} s; {len({tuple(x) for x in toks})} distinct rows; "
          f"row 0: {model.tokenizer.decode(toks[0])[:80]!r}", flush=True)
    R = args.batch
    compiler = None
    if args.warm:
        compiler = l4.GrammarCompiler.for_model(model)
        replay(model, toks, "exec1", compiler)
    for way in args.ways.split(","):
        adv, fill = replay(model, toks, way, compiler)
        print(f"{way:>8}: fill {1e6 * statistics.median(fill) / R:6.2f} us/row median "
              f"({1e6 * sum(fill) / len(fill) / R:6.2f} mean, {1e6 * max(fill) / R:7.2f} max "
              f"step), advance {1e6 * statistics.median(adv) / R:5.2f} us/row", flush=True)


if __name__ == "__main__":
    main()
