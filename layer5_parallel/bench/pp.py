"""Benchmark of the engine under pipeline parallelism (`stack run --layer 5 --pp N` prints it).

`bench_pp`: PP=1 (layer 4's engine; with all the threads, and with one stage's share of
them) vs PP=P on one workload, greedy: tokens/s, whether the
tokens agree, and the pipeline's overlap: per stage, the seconds it computed against the wall
seconds of the pipelined forwards (rank 0's clock from the step's announcement to its last
logits), i.e. its measured idle share, beside the bubble formula (p - 1) / (m + p - 1) for the
mean micro-batches per forward. The course model in fp32 on a CPU (gloo stages); a random
Llama-3.2-1B-shaped model in bf16 on GPUs (one per stage, NCCL), said so.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

import layer4_algorithms as engine

from ..llm import LLM
from ..pipeline_parallel.stage import check_pp_size
from .timeline import plot_timeline
from .tp import _model, workload

l3 = engine.executor


def _run(llm, prompts, max_tokens: int) -> tuple[float, list[list[int]], float]:
    """(tokens/s, greedy tokens, mean engine step seconds)."""
    params = l3.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    if llm.model.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, tokens)) / elapsed, tokens, llm.stats.elapsed_s / max(llm.stats.steps, 1)


def overlap_s(lanes: list[list[tuple]]) -> float:
    """Seconds during which at least two stages computed at once (lanes: per stage, its
    ("F", micro-batch, start, end) intervals)."""
    points = sorted([(e[2], 1) for lane in lanes for e in lane]
                    + [(e[3], -1) for lane in lanes for e in lane])
    together, count, last = 0.0, 0, 0.0
    for t, step in points:
        if count >= 2:
            together += t - last
        count, last = count + step, t
    return together


def bench_pp(stages: int = 2, device: str = "cpu", *, micro_batches: int | None = None,
             num_prompts: int = 16, max_tokens: int = 32, num_blocks: int = 512,
             timeline: str | Path | None = None, tp: int = 1, steps_in_flight: int = 1) -> dict:
    """PP=1 vs PP=stages (each stage over `tp` tensor-parallel ranks) on num_prompts random
    prompts of 16..64 tokens (warmed up once). timeline: a PNG path for the last three
    pipelined forwards, one lane per rank. steps_in_flight: pp_steps_in_flight (in_flight.py)."""
    model, name = _model(device)
    check_pp_size(model.config, stages)
    prompts = workload(num_prompts, model.config.vocab_size, 16, 64)
    kw = dict(num_blocks=num_blocks, max_num_seqs=num_prompts)
    ref = LLM(model, **kw)
    _run(ref, prompts[:2], 2)
    pp1_tok_s, ref_tokens, pp1_step = _run(ref, prompts, max_tokens)
    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, saved // (stages * tp)))  # one process with one rank's share
    try:
        pp1_share_tok_s = _run(ref, prompts, max_tokens)[0]
    finally:
        torch.set_num_threads(saved)
    with LLM(model, pipeline_parallel_size=stages, tensor_parallel_size=tp,
             pp_micro_batches=micro_batches, pp_steps_in_flight=steps_in_flight, **kw) as llm:
        net = llm.runner.net
        _run(llm, prompts[:2], 2)
        net.stage_busy()  # drop the warm-up's figures
        pp_tok_s, tokens, pp_step = _run(llm, prompts, max_tokens)
        rows = net.stage_busy()
        memory = llm.rank_memory()
        threads = torch.get_num_threads()
    wall, forwards = rows[0]["wall_s"], rows[0]["forwards"]
    m = rows[0]["micro_batches"] / max(forwards, 1)
    idle = [1 - r["busy_s"] / wall for r in rows]
    lanes = [r["events"] for r in rows]
    if timeline is not None:
        last = min(3 * steps_in_flight, len(rows[0]["spans"]))
        t0 = min(s for s, _ in rows[0]["spans"][-last:])
        title = f"PP={stages}" + (f" x TP={tp}" if tp > 1 else "")
        what = (f"{m:.0f} micro-batches each" if steps_in_flight == 1 else
                f"{steps_in_flight} steps in flight, {m:.0f} micro-batch each")
        plot_timeline([[e for e in lane if e[2] >= t0] for lane in lanes], timeline,
                      f"{title}, last {last} decode steps ({what})",
                      [f"stage {r['stage']}" + (f" rank {r['rank']}" if tp > 1 else "")
                       for r in rows])
    return {
        "model": name, "device": device, "stages": stages, "tp": tp, "prompts": num_prompts,
        "steps_in_flight": steps_in_flight,
        "max_tokens": max_tokens, "threads_per_stage": threads,
        "pp1_threads": saved, "pp1_tok_s": pp1_tok_s, "pp1_share_tok_s": pp1_share_tok_s,
        "pp_tok_s": pp_tok_s, "speedup": pp_tok_s / max(pp1_tok_s, pp1_share_tok_s),
        "same_tokens": tokens == ref_tokens, "pp1_step_ms": pp1_step * 1e3,
        "pp_step_ms": pp_step * 1e3, "forward_ms": wall / max(forwards, 1) * 1e3,
        "forwards": forwards, "micro_batches_per_forward": m,
        "busy_ms_per_forward": [r["busy_s"] / max(forwards, 1) * 1e3 for r in rows],
        "idle_per_stage": idle, "idle_measured": sum(idle) / len(idle),
        "idle_formula": (stages - 1) / (m + stages - 1), "memory": memory,
        "parallelism": sum(r["busy_s"] for r in rows) / wall,
        # over the whole run (with steps in flight rank 0's forwards overlap: no forward wall)
        "busy_at_once": sum(r["busy_s"] for r in rows) * pp_tok_s / sum(map(len, tokens)),
        "parallelism_formula": tp * stages * m / (m + stages - 1),  # ranks busy at once
        "together_share": overlap_s(lanes) / sum(e - s for s, e in rows[0]["spans"]),
    }


def format_pp(r: dict) -> str:
    tp = r.get("tp", 1)
    busy = ", ".join(f"{'rank' if tp > 1 else 'stage'} {s} {b:.2f} ms ({1 - i:.0%})"
                     for s, (b, i) in enumerate(zip(r["busy_ms_per_forward"],
                                                    r["idle_per_stage"], strict=True)))
    return (f"{r['model']} on {r['device']}, {r['prompts']} prompts x {r['max_tokens']} greedy "
            f"tokens, {r['threads_per_stage']} thread(s) per stage\n"
            f"tokens/s: PP=1 {r['pp1_tok_s']:,.0f} ({r['pp1_threads']} threads; "
            f"{r['pp1_share_tok_s']:,.0f} with one rank's threads), PP={r['stages']}"
            f"{f' x TP={tp}' if tp > 1 else ''} "
            f"{r['pp_tok_s']:,.0f} (x{r['speedup']:.2f} the better PP=1); same greedy tokens: "
            f"{r['same_tokens']}\n"
            f"pipelined forward {r['forward_ms']:.2f} ms (engine step {r['pp_step_ms']:.2f} ms, "
            f"PP=1 step {r['pp1_step_ms']:.2f} ms), {r['micro_batches_per_forward']:.1f} "
            f"micro-batches each; busy per forward: {busy}\n"
            f"idle share: measured {r['idle_measured']:.0%} (mean over stages) vs bubble "
            f"(p-1)/(m+p-1) = {r['idle_formula']:.0%}; stages busy at once: sum(busy)/wall = "
            f"{r['parallelism']:.2f} vs p*m/(m+p-1) = {r['parallelism_formula']:.2f}; two or "
            f"more stages computing together {r['together_share']:.0%} of the time"
            + (f"\n{r['steps_in_flight']} steps in flight (each forward above is one lane's "
               f"step): stages busy at once over the whole run {r['busy_at_once']:.2f}"
               if r.get("steps_in_flight", 1) > 1 else ""))
