"""The offline side of the serving benchmark: layer 5's LLM over the same prompts, with the
KV pool every engine gets. `prefill_ms`: each prompt alone, ms to its first token (the floor
of a server's TTFT); `offline_throughput`: output tok/s over the whole workload (the ceiling
of a server's throughput)."""
from __future__ import annotations

import argparse
import math
import time

import layer5_parallel as l5

from .dataset import BenchRequest


def kv_blocks(args: argparse.Namespace, block_size: int) -> int:
    """The one KV pool all engines get (--num-blocks, else): every seat can hold its longest
    sequence (chat: the caps; random: lengths up to 1.5x the means, re-encoded text up to 2x
    as long), plus one block per seat, so no engine preempts and none takes a GPU's worth."""
    if args.num_blocks:
        return args.num_blocks
    if args.dataset == "chat":
        longest = args.input_len + args.output_len
    else:
        longest = 3 * args.input_len + math.ceil(1.5 * args.output_len)
    return args.max_num_seqs * (math.ceil(longest / block_size) + 1)


def _params(r: BenchRequest, max_tokens: int | None = None) -> l5.SamplingParams:
    return l5.SamplingParams(temperature=0, max_tokens=max_tokens or r.max_tokens,
                             ignore_eos=r.ignore_eos, stop=list(r.stop))


def prefill_ms(llm, requests: list[BenchRequest]) -> list[float]:
    """Each prompt alone through the offline engine: ms to its first token (max_tokens=1)."""
    for r in requests[:2]:  # warm-up
        llm.generate([r.prompt_ids], _params(r, 1))
    times = []
    for r in requests:
        start = time.perf_counter()
        llm.generate([r.prompt_ids], _params(r, 1))
        times.append((time.perf_counter() - start) * 1e3)
    return times


def offline_throughput(llm, requests: list[BenchRequest], repeats: int = 2) -> dict:
    """Output tokens/s of the offline engine over the whole workload: the best of `repeats`
    runs (the first also warms up every batch shape the workload reaches)."""
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate([r.prompt_ids for r in requests], [_params(r) for r in requests])
        dt = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if best is None or tokens / dt > best["output_throughput"]:
            best = {"output_throughput": tokens / dt, "output_tokens": tokens, "duration_s": dt}
    return best
