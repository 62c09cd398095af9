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
from collections.abc import Sequence
from pathlib import Path

import torch

from layer3_model import Model, SamplingParams, course_model_dir, load

from .speculative import SpeculativeDecoder

DRAFT_PROMPT = "HAMLET.\nTo be, or not to be, that is the question.\n\nHORATIO.\n"
PASSAGE = ("KING.\nNow is the winter of our discontent\nMade glorious summer by this sun of York;\n"
           "And all the clouds that lour'd upon our house\nIn the deep bosom of the ocean buried.\n\n")
# copy-heavy: the passage twice, then its first line again; the model goes on copying
COPY_PROMPT = PASSAGE + PASSAGE + "KING.\nNow is the winter of our discontent\n"


def _median_run(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    runs = [fn() for _ in range(repeats)]
    rates = [r.decode_tokens_per_s for r in runs]
    mid = statistics.median(rates)
    return mid, runs[rates.index(mid)] if mid in rates else runs[-1]


def _baseline(target: Model, prompt: str, params: SamplingParams, repeats: int) -> tuple[float, list[float], list[int]]:
    rates, ids = [], []
    target.generate_outputs([prompt], params)
    for _ in range(repeats):
        ids = target.generate_outputs([prompt], params)[0].token_ids
        rates.append(target.stats.decode_tokens_per_s)
    return statistics.median(rates), rates, ids


def _spec(target: Model, proposer, k: int, prompt: str, params: SamplingParams, repeats: int,
          reference: list[int]) -> dict:
    dec = SpeculativeDecoder(target, proposer, k)
    dec.generate([prompt], params)  # warm-up
    rates, stats, same = [], None, True
    for _ in range(repeats):
        out = dec.generate([prompt], params)[0].token_ids
        same &= out == reference
        rates.append(dec.stats.decode_tokens_per_s)
        if stats is None or rates[-1] == statistics.median(rates):
            stats = dec.stats
    s = dec.stats
    return {"k": k, "tokens_per_s": statistics.median(rates), "runs_tokens_per_s": rates,
            "matches_greedy": same, "acceptance_rate": s.acceptance_rate,
            "mean_accepted_per_round": s.mean_accepted_per_round, "mean_tokens_per_round": s.mean_tokens_per_round,
            "rounds": s.rounds, "draft_steps": s.draft_steps,
            "propose_ms_per_round": 1e3 * s.propose_s / max(s.rounds, 1),
            "verify_ms_per_round": 1e3 * s.verify_s / max(s.rounds, 1)}


def bench_speculative(target_dir: str | Path | None = None, draft_dir: str | Path | None = None, *,
                      ks: Sequence[int] = (2, 3, 4, 5, 6), new_tokens: int = 128, repeats: int = 3,
                      threads: int | None = 1, device: str = "cpu", dtype: str = "float32",
                      ngram_ks: Sequence[int] = (2, 4, 6, 8), draft_prompt: str = DRAFT_PROMPT,
                      copy_prompt: str = COPY_PROMPT) -> dict:
    """Batch-1 greedy decode tokens/s: the target alone (layer 3's generate), target + draft
    for each k in ks, and n-gram lookup for each k in ngram_ks on a copy-heavy prompt.
    Defaults: the course target and draft. Each entry: tokens/s (median of `repeats`),
    speed-up over the baseline of the same prompt, acceptance rate, tokens per round, ms
    spent proposing and verifying per round, and whether the tokens equal plain greedy's."""
    if threads is not None:
        torch.set_num_threads(threads)
    target = load(target_dir or course_model_dir("target"), device=device, dtype=dtype)
    draft = load(draft_dir or course_model_dir("draft"), device=device, dtype=dtype)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    result: dict = {"device": str(target.device), "threads": torch.get_num_threads(), "dtype": dtype,
                    "new_tokens": new_tokens, "repeats": repeats, "draft": [], "ngram": []}
    for name, prompt, proposer, kk in (("draft", draft_prompt, draft, ks), ("ngram", copy_prompt, "ngram", ngram_ks)):
        base, runs, ref = _baseline(target, prompt, params, repeats)
        result[f"baseline_{name}_prompt"] = {"tokens_per_s": base, "runs_tokens_per_s": runs}
        if name == "draft":
            result["draft_alone_tokens_per_s"] = _baseline(draft, prompt, params, repeats)[0]
        for k in kk:
            entry = _spec(target, proposer, k, prompt, params, repeats, ref)
            entry["speedup"] = entry["tokens_per_s"] / base
            result[name].append(entry)
    return result


def format_bench(result: dict) -> str:
    """A small text table of bench_speculative's result."""
    lines = [f"speculative decoding, batch 1 greedy, {result['new_tokens']} new tokens, device "
             f"{result['device']}, {result['threads']} thread(s), {result['dtype']}, median of {result['repeats']}"]
    for name in ("draft", "ngram"):
        base = result[f"baseline_{name}_prompt"]["tokens_per_s"]
        lines.append(f"  {name:5s} prompt: target alone {base:7.1f} tok/s"
                     + (f"; draft alone {result['draft_alone_tokens_per_s']:.1f} tok/s" if name == "draft" else ""))
        for e in result[name]:
            lines.append(f"    k={e['k']}: {e['tokens_per_s']:7.1f} tok/s  x{e['speedup']:.2f}  accept "
                         f"{e['acceptance_rate']:.2f}  tokens/round {e['mean_tokens_per_round']:.2f}  propose "
                         f"{e['propose_ms_per_round']:.2f} ms + verify {e['verify_ms_per_round']:.2f} ms per round"
                         + ("" if e["matches_greedy"] else "  (tokens differ from greedy!)"))
    return "\n".join(lines)
