"""Measuring speculative decoding: tokens/s of the target alone vs with a draft model or n-gram
lookup, at batch 1 greedy, with acceptance rates and where the time goes.

`bench_speculative()` returns a dict (the engine's bench command prints or stores it).
Greedy speculation emits exactly the baseline's tokens, so tokens/s compare like for like;
each figure is the median of `repeats` timed runs after a warm-up. On a shared CPU set
`threads=1` (and pin the process, e.g. `taskset -c 1`): small matmuls gain nothing from
more threads, and other processes on the cores make multi-threaded timings noisy.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from layer3_model import Model, SamplingParams, course_model_dir, load

from ..spec.decoder import SpeculativeDecoder

PROMPTS = {
    "hamlet": "HAMLET.\nTo be, or not to be, that is the question.\n\nHORATIO.\n",
    "romeo": "ROMEO.\nBut soft, what light through yonder window breaks?\n\n",
    "lear": "KING LEAR.\n",
}
PASSAGE = ("KING.\nNow is the winter of our discontent\nMade glorious summer by this sun of York;\n"
           "And all the clouds that lour'd upon our house\nIn the deep bosom of the ocean "
           "buried.\n\n")
# copy-heavy: the passage twice, then its first line again (the course model does not
# actually copy it: 11M parameters learned little in-context copying; see README.md)
COPY_PROMPT = PASSAGE + PASSAGE + "KING.\nNow is the winter of our discontent\n"


def _rates(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    return [fn() for _ in range(repeats)]


def _rate(run: Callable[[], object], clock: str) -> float:
    """Tokens/s of one generate call: run() generates and returns its stats. clock "wall":
    the call's own decode rate (wall clock); "cpu": generated tokens over this thread's CPU
    time for the whole call (prefill included), which time stolen by other processes on a
    loaded machine does not inflate (with one torch thread all work runs on this thread)."""
    t = time.thread_time()
    stats = run()
    if clock == "wall":
        return stats.decode_tokens_per_s
    return stats.generated_tokens / max(time.thread_time() - t, 1e-9)


def _greedy_rate(model: Model, prompt: str, params: SamplingParams, clock: str = "wall") -> float:
    def run():
        model.generate_outputs([prompt], params)
        return model.stats
    return _rate(run, clock)


def _spec_row(target: Model, proposer, k: int, stop_below: float | None, prompt: str,
              params: SamplingParams, repeats: int, reference: list[int],
              clock: str = "wall", ngram_first: bool = False, adaptive_k: bool = False,
              lean_draft: bool = True) -> dict:
    dec = SpeculativeDecoder(target, proposer, k, stop_below=stop_below, ngram_first=ngram_first,
                             adaptive_k=adaptive_k, lean_draft=lean_draft)
    same = True

    def once() -> float:
        nonlocal same
        same &= dec.generate([prompt], params)[0].token_ids == reference
        return dec.stats

    def once_rate() -> float:
        return _rate(once, clock)

    rates = _rates(once_rate, repeats)
    s = dec.stats  # counts are the same every run (greedy); times are the last run's
    return {"k": k, "stop_below": stop_below, "tokens_per_s": statistics.median(rates),
            "runs_tokens_per_s": rates,
            "matches_greedy": same, "acceptance_rate": s.acceptance_rate,
            "proposed_per_round": s.proposed / max(s.rounds, 1),
            "mean_accepted_per_round": s.mean_accepted_per_round,
            "mean_tokens_per_round": s.mean_tokens_per_round,
            "rounds": s.rounds, "draft_steps": s.draft_steps,
            "propose_ms_per_round": 1e3 * s.propose_s / max(s.rounds, 1),
            "verify_ms_per_round": 1e3 * s.verify_s / max(s.rounds, 1)}


def bench_speculative(target_dir: str | Path | None = None, draft_dir: str | Path | None = None, *,
                      ks: Sequence[int] = (2, 3, 4, 5, 6),
                      dynamic: Sequence[tuple[int, float]] = ((3, 0.4), (4, 0.3)),
                      ngram_ks: Sequence[int] = (2, 4, 6),
                      hybrid_ks: Sequence[int] = (), adaptive: Sequence[tuple[str, int]] = (),
                      prompts: dict[str, str] | None = None,
                      copy_prompt: str = COPY_PROMPT, new_tokens: int = 128, repeats: int = 3,
                      threads: int | None = 1, device: str = "cpu", dtype: str = "float32",
                      clock: str = "wall", progress: Callable[[str], None] | None = None,
                      lean_draft: bool = True) -> dict:
    """Batch-1 greedy decode tokens/s, per prompt: the target alone (layer 3's generate), the
    draft alone, target + draft for each fixed k in ks and each (k, stop_below) in dynamic,
    n-gram lookup for each k in ngram_ks (on every prompt and on a copy-heavy one), and
    "ngram+draft" (lookup first, the draft where it finds nothing) for each k in hybrid_ks,
    and each (method, k) in adaptive with adaptive_k (k the most a round proposes).
    Defaults: the course target and draft. Each row: tokens/s (median of `repeats`), its
    speed-up over the same prompt's baseline, acceptance rate, tokens per verify round, ms
    proposing and verifying per round, and whether the tokens equal plain greedy's.
    `summary` holds the geometric-mean speed-up of each configuration over the prompts.
    clock: "wall" (decode tokens/s) or "cpu" (tokens per second of this thread's CPU time,
    whole call: the steadier figure on a loaded shared CPU; see _rate).
    lean_draft: False runs the draft's steps through layer 3's serving forward (the path
    before LeanDecodeStep), for before/after figures from one machine.
    progress: called with a line as each part finishes (its row and the seconds since the
    start), so a run cut off by a time limit still shows how far it got and at what pace."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    start = time.perf_counter()

    def say(line: str) -> None:
        if progress is not None:
            progress(f"[{time.perf_counter() - start:6.1f} s] {line}")

    if threads is not None:
        torch.set_num_threads(threads)
    target = load(target_dir or course_model_dir("target"), device=device, dtype=dtype)
    draft = load(draft_dir or course_model_dir("draft"), device=device, dtype=dtype)
    say(f"{device}: target and draft loaded")
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    prompts = dict(prompts or PROMPTS)
    result: dict = {"device": str(target.device), "threads": torch.get_num_threads(),
                    "dtype": dtype, "clock": clock, "lean_draft": lean_draft,
                    "new_tokens": new_tokens, "repeats": repeats, "prompts": {}, "summary": {}}
    configs = ([("draft", k, None) for k in ks] + [("draft", k, sb) for k, sb in dynamic]
               + [("ngram", k, None) for k in ngram_ks]
               + [("ngram+draft", k, None) for k in hybrid_ks]
               + [(f"{m} adaptive", k, None) for m, k in adaptive])
    for name, prompt in [*prompts.items(), ("copy", copy_prompt)]:
        draft_rates = _rates(lambda m=draft, p=prompt: _greedy_rate(m, p, params, clock), repeats)
        rates = _rates(lambda m=target, p=prompt: _greedy_rate(m, p, params, clock), repeats)
        ref = target.generate_outputs([prompt], params)[0].token_ids
        b = statistics.median(rates)
        say(f"prompt {name}: target alone {b:.1f} tok/s, draft alone "
            f"{statistics.median(draft_rates):.1f} tok/s")
        rows = []
        for method, k, sb in configs:
            base = method.removesuffix(" adaptive")
            if name == "copy" and base == "draft":
                continue
            row = _spec_row(target, "ngram" if base == "ngram" else draft, k, sb, prompt,
                            params, repeats, ref, clock, ngram_first=base == "ngram+draft",
                            adaptive_k=method.endswith(" adaptive"), lean_draft=lean_draft)
            rows.append({"method": method, **row, "speedup": row["tokens_per_s"] / b})
            say(f"  {name} {_row_line(rows[-1])}")
        result["prompts"][name] = {"target_tokens_per_s": b, "target_runs": rates,
                                   "draft_tokens_per_s": statistics.median(draft_rates),
                                   "rows": rows}
    for method, k, sb in configs:
        ups = [r["speedup"] for p in result["prompts"].values() for r in p["rows"]
               if (r["method"], r["k"], r["stop_below"]) == (method, k, sb)]
        result["summary"][f"{method} k={k}" + (f" stop_below={sb}" if sb is not None else "")] = \
            statistics.geometric_mean(ups)
    return result


def _row_line(e: dict) -> str:
    """One configuration's figures on one line (format_bench's and the progress lines)."""
    adaptive = e["method"].endswith(" adaptive")  # "k<=K": k adapts, at most K
    cfg = f"{e['method'].removesuffix(' adaptive')} k{'<=' if adaptive else '='}{e['k']}"
    if e["stop_below"] is not None:
        cfg += f" stop<{e['stop_below']}"
    return (f"{cfg:17s}{e['tokens_per_s']:7.1f} x{e['speedup']:.2f} "
            f"acc {e['acceptance_rate']:.2f} tok/rnd {e['mean_tokens_per_round']:.2f} "
            f"{e['propose_ms_per_round']:.2f}+{e['verify_ms_per_round']:.2f} ms"
            + ("" if e["matches_greedy"] else " DIFFERS FROM GREEDY"))


def format_bench(result: dict) -> str:
    """A small text table of bench_speculative's result, at most 80 columns wide."""
    lines = [f"speculative decoding, batch 1 greedy, {result['new_tokens']} new tokens, "
             f"{result['device']},",
             f"{result['threads']} thread(s), {result['dtype']}, "
             f"{result.get('clock', 'wall')} clock, median of {result['repeats']}; per config: "
             "tok/s, speed-up,",
             "acceptance, tokens per verify round, ms proposing + verifying per round"]
    for name, p in result["prompts"].items():
        lines.append(f"  prompt {name}: target alone {p['target_tokens_per_s']:.1f} tok/s, "
                     f"draft alone {p['draft_tokens_per_s']:.1f} tok/s")
        lines += [f"    {_row_line(e)}" for e in p["rows"]]
    lines.append("  geometric-mean speed-up over the prompts:")
    lines += [f"    {k}: x{v:.2f}" for k, v in result["summary"].items()]
    return "\n".join(lines)
