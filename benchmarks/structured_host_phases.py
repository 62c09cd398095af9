"""The host's share of a constrained decode step, phase by phase, on a CPU (no model run).

    python benchmarks/structured_host_phases.py [--batch 32] [--steps 64] [--out DIR]

--batch rows, each under its own JSON schema (tests/layer4/schemas.py, one schema a row),
replay token streams that the grammars themselves chose (a seeded walk over each step's
allowed tokens, EOS left out; a document that ends starts again, as a new request would):
so every row is mid-document in a state of its own, as in a real batch of different
requests, and no model is needed. Each step then times, on this thread, per way:

    advance   the rows' grammars take the step's sampled tokens
              rowwise: GrammarState.accept_at per row (what appending a token does)
              matchers_only: LLMatcher.consume_token per row (llguidance alone)
    fill      the rows' next-token bitmasks (R, W) int32
              rowwise: each matcher at its row's address, one call a row
              engine: TokenMasks.prepare (what the engine's own thread does)
    apply     the bitmask applied to (R, V) float32 logits with torch on the CPU:
              apply_token_bitmask_, TokenMasks.launch (as the engine calls it), and
              unpack + masked_fill_ (the plain way, the engine's before a byte lookup)

Printed: each the median over steps in microseconds (and per row), written to
DIR/structured_host_phases.json with --out. Timings on a shared CPU are noisy: read the
medians, and compare ways within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.layer4.schemas

import layer3_model as l3  # noqa: E402
import layer4_algorithms as l4  # noqa: E402
from tests.layer4.schemas import SCHEMAS  # noqa: E402

S = l4.structured


class Row:
    """A sequence as TokenMasks reads it: its grammar only."""

    def __init__(self, grammar) -> None:
        self.grammar = grammar


def walk(compiler, schema: dict, steps: int, rng: np.random.Generator, V: int) -> list[int]:
    """steps tokens a fresh grammar of schema allows, one after another (uniform over the
    allowed tokens but EOS); -1 where the document ended and a fresh one starts."""
    W = (V + 31) // 32
    row = np.zeros(W, np.int32)
    eos = set(compiler.eos_token_ids)
    out: list[int] = []
    state = compiler.state(l4.StructuredOutputsParams(json=schema))
    while len(out) < steps:
        state.fill(row)
        allowed = [t for t in np.flatnonzero(np.unpackbits(row.view(np.uint8),
                                                           bitorder="little")[:V])
                   if t not in eos]
        if not allowed or state.matcher.is_stopped():
            out.append(-1)
            state = compiler.state(l4.StructuredOutputsParams(json=schema))
            continue
        t = int(rng.choice(allowed))
        assert state.accept(t)
        out.append(t)
    return out


def unpack_masked_fill(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The plain torch way (the reference the engine's CPU path is checked against): unpack
    the bits through (R, W, 32) int32, then masked_fill_."""
    return logits.masked_fill_(~S.unpack(bitmask, logits.shape[1]), float("-inf"))


def accept_each(at: list) -> None:
    """(state, token, position) each: what appending a step's tokens does to the grammars."""
    for state, token, position in at:
        state.accept_at(token, position)


def consume_each(pairs: list) -> None:
    """(matcher, token) each: llguidance's own cost, no wrapper."""
    for m, token in pairs:
        m.consume_token(token)


def fill_each(pairs: list, base: int, size: int) -> None:
    """(matcher, row) each: a row's mask written at its address, one call a row."""
    for m, j in pairs:
        m.unsafe_compute_mask_ptr(base + j * size, size)


def med(xs: list[float]) -> float:
    return round(1e6 * statistics.median(xs), 1)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = l3.load(l3.course_model_dir("target"), device="cpu", dtype="float32")
    V = model.config.vocab_size
    compiler = l4.GrammarCompiler.for_model(model)
    rng = np.random.default_rng(0)
    schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(args.batch)]
    t0 = time.perf_counter()
    streams = [walk(compiler, s, args.steps, rng, V) for s in schemas]
    print(f"streams: {args.batch} rows x {args.steps} tokens in "
          f"{time.perf_counter() - t0:.1f} s ({sum(x.count(-1) for x in streams)} documents "
          f"ended and restarted)", flush=True)
    def fresh(c=compiler) -> list:
        return [c.state(l4.StructuredOutputsParams(json=s)) for s in schemas]


    B, W = args.batch, (V + 31) // 32
    ways: dict[str, list[float]] = {}

    def timed(name: str, fn, *a):
        t = time.perf_counter()
        r = fn(*a)
        ways.setdefault(name, []).append(time.perf_counter() - t)
        return r

    masks = S.TokenMasks(V, "cpu", rows=B)
    bitmask = S.allocate(B, V)
    logits0 = torch.randn(B, V)
    # two replays of the same streams: the first warms llguidance's lazily built lexers (a
    # fresh compile's first visits of a state cost far more), the second is timed
    for rep in range(2):
        states = fresh()
        rows = [Row(s) for s in states]
        prepared = None
        positions = [0] * B
        if rep:
            ways.clear()
        for step in range(args.steps):
            toks = [x[step] for x in streams]
            for j, t in enumerate(toks):  # a document ended: a fresh request in its row
                if t == -1:
                    states[j] = compiler.state(l4.StructuredOutputsParams(json=schemas[j]))
                    rows[j].grammar, positions[j] = states[j], 0
            live = [j for j, t in enumerate(toks) if t != -1]
            # advance: one way on the live states (the other on copies: each state takes a
            # token once), checked equal below
            raw = [(states[j].matcher.deep_copy(), toks[j]) for j in live]
            at = [(states[j], toks[j], positions[j]) for j in live]
            order = [("advance_rowwise", accept_each, (at,)),
                     ("advance_matchers_only", consume_each, (raw,))]
            for name, fn, a in order[step % 2:] + order[:step % 2]:  # (no way always first)
                timed(name, fn, *a)
            for j in live:
                positions[j] += 1
            pairs = [(s.matcher, j) for j, s in enumerate(states)]
            base, size = bitmask.data_ptr(), W * 4
            order = [("fill_rowwise", fill_each, (pairs, base, size)),
                     ("fill_engine_prepare", masks.prepare, (rows,))]
            for name, fn, a in order[step % 2:] + order[:step % 2]:
                got = timed(name, fn, *a)
                prepared = got if name == "fill_engine_prepare" else prepared
            assert torch.equal(masks._host[masks._arena][:B * W].view(B, W), bitmask)
            outs = []
            order = [("apply_torch", S.apply_token_bitmask_, bitmask),
                     ("apply_unpack_masked_fill", unpack_masked_fill, bitmask),
                     ("apply_engine_launch", masks.launch, prepared)]
            for name, fn, a in order[step % 3:] + order[:step % 3]:
                logits = logits0.clone()
                timed(name, fn, logits, a)
                outs.append(logits)
            assert all(torch.equal(outs[0], x) for x in outs[1:])
    res = {k: med(v) for k, v in ways.items()}
    out = {"env": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                   "torch": torch.__version__, "vocab": V, "batch": B, "steps": args.steps,
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
           "us_per_step": res,
           "us_per_row": {k: round(v / B, 2) for k, v in res.items()}}
    for k, v in res.items():
        print(f"{k:32s} {v:9.1f} us a step  ({v / B:6.2f} us a row)", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "structured_host_phases.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
