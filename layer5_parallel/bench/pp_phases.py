"""Where rank 0's step goes under pipeline parallelism: one engine vs PP with steps in flight.

    python -m layer5_parallel.bench.pp_phases [--seqs 64,128,256] [--new-tokens 64]
        [--layouts 1,pp2gf] [--shape llama-3.2-1b|llama-3.1-8b] [--prefill-first]
    (GPUs: the shape with random bf16 weights drawn on each GPU, triton kernels, CUDA graphs /
    stage graphs; a CPU: step_phases' tiny model on gloo, 64 sequences)

Layouts: 1 (one engine), pp2g (PP=2, 2 micro-batches, drained), pp2gf (PP=2, 2 steps in
flight), pp2gF (3 in flight), pp2gs (pp2gf with async scheduling off: each lane's step read
on the host before the lane's next is dispatched, as before the landing overlapped it).

With steps in flight every lane's step pays rank 0's fixed host cost (schedule, inputs, the
control message, the hand-offs, the launches, the landing), so that cost, not the GPUs,
decides whether PP beats one GPU. Each layout runs in this process (rank 0 here, the other
stages in worker processes): one engine, a warm-up, then for each count of `--seqs` a timed
greedy run of that many prompts of `--prompt` tokens and `--new-tokens` new ones (the same
prompts for every layout; a row per layout and count, its ratios against the first layout's
row of that count, its tokens compared with that row's and with the first pipeline
layout's), under step_phases' PhaseClock (every moment of
a decode step charged to the innermost phase; wall and thread CPU time) with the pipeline's
own parts named as well:

    graph inputs     (a decode step) the runner's hand-over of its host arrays to the
                     pipeline (runner.StageDecode), what the phases below leave of it
    dispatch         PPModel.dispatch's own code (the step's cuts, stats, bookkeeping)
    step broadcast   the step's ids | slots | tables packed and broadcast to the stages
    micro contexts   the micro-batches' cuts and contexts
    stage graph      rank 0's stage replayed from its graph (inputs into the static buffers,
                     the replay; on a CPU the stage's eager forward)
    stage forward    rank 0's stage run eagerly (prefill, mixed steps)
    hand-off send    posting a micro-batch to the next stage / receiving one (rank 0: the
    hand-off recv    last stage's logits or token ids), and waiting for a hand-off
    hand-off wait
    collect          PPModel.collect's own code (the step's logits / ids into their buffer)

A lane's step is a decode step of its own sequences: the figures are per (lane) step, as the
engine counts them. Printed per layout: tokens/s (the whole run, prefill included), decode
tokens/s (tokens of the decode-only steps scheduled after the run's last prefill, over the
time from that first decode-only step to the run's end: the regime of a full decode batch,
where the gain of PP is meant to show), steps, ms per step, and the phases.

Where PP=2 can pay (count first): a decode step reads the weights W once per micro-batch and
the step's KV cache; one GPU's step costs about W + KV (+ the GEMMs' FLOPs where a big batch
makes them the bound), PP=2 with two lanes about W + KV/2 per GPU per round: at most
(W + KV)/(W + KV/2), 1.4x only where KV >= 1.33 W (8B shape: 128 KiB a token, W ~ 15 GB: 256
sequences of ~1,000 tokens), and only while rank 0's host work per lane step stays below a
lane step's GPU time. `--shape llama-3.1-8b` is that regime.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import time
from pathlib import Path

import torch

import layer4_algorithms as engine

from ..pipeline_parallel import engine as pp_engine
from ..pipeline_parallel import stage as pp_stage
from .dp import differences
from .step_phases import PhaseClock, format_summary, tiny_model

l3 = engine.executor
LAYOUTS = {
    "1": {},
    "pp2g": dict(pipeline_parallel_size=2, pp_micro_batches=2),
    "pp2gf": dict(pipeline_parallel_size=2, pp_steps_in_flight=2, pp_micro_batches=1),
    "pp2gF": dict(pipeline_parallel_size=2, pp_steps_in_flight=3, pp_micro_batches=1),
    "pp2gs": dict(pipeline_parallel_size=2, pp_steps_in_flight=2, pp_micro_batches=1,
                  async_scheduling=False),
}
SHAPES = ("llama-3.2-1b", "llama-3.1-8b")


class DecodeWindow:
    """The decode-only stretch of a run: every schedule() of `llm`'s scheduler noted (time,
    rows, decode-only or not); `rate(end)` is the rows of the decode-only steps scheduled after
    the last step with a prefill, over the time from the first of them to `end`."""

    def __init__(self, llm) -> None:
        self.sched, self.marks = llm.scheduler, []
        own = self.sched.schedule  # (the instance's: a PhaseClock's wrapper, if any)

        def schedule():
            out = own()
            if out.scheduled:
                self.marks.append((time.perf_counter(), len(out.scheduled), all(
                    s.num_new_tokens == 1 and not s.spec_token_ids for s in out.scheduled)))
            return out
        self.sched.schedule = schedule
        self._own = own

    def close(self) -> None:
        self.sched.schedule = self._own

    def rate(self, end: float) -> tuple[float, int]:
        """(tokens/s, decode steps) of the window; (nan, 0) when no decode-only step followed
        the last prefill."""
        last = max((i for i, m in enumerate(self.marks) if not m[2]), default=-1)
        window = self.marks[last + 1:]
        if not window or end <= window[0][0]:
            return float("nan"), 0
        return sum(m[1] for m in window) / (end - window[0][0]), len(window)



class PPPhaseClock(PhaseClock):
    """PhaseClock with the pipeline's parts named (see the module docstring)."""

    def __init__(self, llm) -> None:
        super().__init__(llm)
        net = llm.runner.net
        if not hasattr(net, "dispatch"):  # one process: layer 4's phases only
            return
        self._wrap(net, "dispatch", "dispatch")
        self._wrap(net, "_dispatch_decode", "dispatch")
        self._wrap(net, "collect", "collect")
        self._wrap(pp_engine, "pack_step", "step broadcast")
        self._wrap(net.group.comm, "broadcast", "step broadcast")
        self._wrap(net.group.comm, "broadcast_start", "step broadcast")
        self._wrap(pp_stage, "micro_batches", "micro contexts")
        self._wrap(pp_stage, "micro_contexts", "micro contexts")
        self._wrap(pp_stage, "send", "hand-off send")
        self._wrap(pp_stage, "recv", "hand-off recv")
        self._wrap(pp_stage, "wait_sends", "hand-off wait")
        self._wrap(net.shard, "forward", "stage forward")
        if net.graphs is not None:
            self._wrap(net.graphs, "run_micro", "stage graph")
            self._wrap(net.graphs, "run_micro_host", "stage graph")


def workload(seqs: int, prompt: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (prompt,), generator=g).tolist() for _ in range(seqs)]


def run_layout(key: str, model_fn, prompts, counts: list[int], new_tokens: int, gpu: bool,
               prefill_first: bool = False, profile_top: int = 0) -> list[dict]:
    """One layout's engine in this process (sized for every prompt): a warm-up, then for each
    count n in `counts` a timed greedy run of the first n prompts under the clock; a row per
    run. Warm-up: a quarter of the prompts with up to 16 new tokens (every kernel compiled),
    or with prefill_first every prompt with 2 new tokens, twice: the prompts stay in the
    prefix cache (the timed runs recompute only their last block and decode the whole batch
    from their first steps) and the second pass compiles that path. profile_top: after the
    last run the same run again under cProfile (this process: rank 0), its `profile_top`
    functions of most own time listed in that row."""
    blocks = len(prompts) * (-(-(len(prompts[0]) + new_tokens) // 16) + 1) + 64  # (+1: slack)
    kw = dict(LAYOUTS[key], cuda_graph=True, max_num_seqs=len(prompts), tp_timeout_s=120.0,
              num_blocks=blocks, block_size=16)
    from ..llm import LLM  # noqa: PLC0415

    rows = []
    start = time.perf_counter()
    with LLM(model_fn(), **kw) as llm:
        ready = time.perf_counter() - start
        params = l3.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        if prefill_first:
            two = l3.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            llm.generate(prompts, two)
            llm.generate(prompts, two)
        else:
            llm.generate(prompts[: max(2, len(prompts) // 4)],
                         l3.SamplingParams(temperature=0.0, ignore_eos=True,
                                           max_tokens=min(new_tokens, 16)))
        for n in counts:
            clock = PPPhaseClock(llm)
            window = DecodeWindow(llm)
            try:
                if gpu:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs = llm.generate(prompts[:n], params)
                end = time.perf_counter()
                wall = end - t0
            finally:
                window.close()
                clock.close()
            steps = llm.stats.steps
            decode_tok_s, decode_steps = window.rate(end)
            made = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append({"layout": key, "seqs": n, "tok_s": made / wall, "seconds": wall,
                         "steps": steps, "decode_tok_s": decode_tok_s,
                         "decode_steps": decode_steps, "ms_per_step": 1e3 * wall / max(steps, 1),
                         "startup_s": ready, "phases": clock.summary(), "profile": [],
                         "tokens": [o.outputs[0].token_ids for o in outs]})
        if profile_top:
            rows[-1]["profile"] = own_time(llm, prompts[:counts[-1]], params, profile_top)
    if gpu:  # the next layout sizes nothing from free memory, but starts from an empty pool
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def pp2_floor(config, seqs: int, context: float, itemsize: int) -> float:
    """(W + KV)/(W + KV/2): PP=2 with two lanes against one GPU where a decode step costs the
    bytes it reads: W the weights (the embedding table aside: one row a token), KV the
    step's cache, `seqs` sequences of `context` tokens. (The ceiling when the GPUs set the
    pace; rank 0's host per lane step can only lower it.)"""
    H, L, ffn = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    weights = itemsize * (L * (H * (q + 2 * kv) + q * H + 3 * H * ffn) + config.vocab_size * H)
    cache = itemsize * 2 * L * kv * seqs * context
    return (weights + cache) / (weights + cache / 2)


def words(d: dict) -> str:
    """differences() in words."""
    if d["same_tokens"]:
        return "same as"
    return (f"{d['seqs_differ']} sequences differ (first at {d['first_difference']}, median "
            f"{d['median_first_difference']:g}) from")


def own_time(llm, prompts, params, top: int) -> list[tuple[str, int, float]]:
    """One more run of `prompts` under cProfile: the `top` functions by own time, as
    (file:line(function), calls, own us per step of that run). (cProfile's hooks slow the
    Python it times: the ranking, not the sum, is what it tells.)"""
    prof = cProfile.Profile()
    prof.enable()
    try:
        llm.generate(prompts, params)
    finally:
        prof.disable()
    steps = max(llm.stats.steps, 1)
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [(f"{Path(f).name}:{line}({fn})", nc, 1e6 * tt / steps)
            for (f, line, fn), (_, nc, tt, _, _) in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m layer5_parallel.bench.pp_phases")
    ap.add_argument("--layouts", default="1,pp2gf")
    ap.add_argument("--seqs", default=None,
                    help="sequence counts, comma-separated: one engine a layout runs each "
                         "(default: 256 on GPUs, 64 on a CPU)")
    ap.add_argument("--prompt", type=int, default=None, help="default: 128 on GPUs, 16 on a CPU")
    ap.add_argument("--new-tokens", type=int, default=None, help="default: 64 (CPU: 16)")
    ap.add_argument("--shape", default=SHAPES[0], choices=SHAPES,
                    help="the shape on GPUs (random bf16 weights; a CPU runs its tiny model)")
    ap.add_argument("--prefill-first", action="store_true",
                    help="prefill every prompt before the timed run (prefix cache): it then "
                         "decodes a full batch from its first steps")
    ap.add_argument("--profile-top", type=int, default=0,
                    help="after each timed run, one more under cProfile: its N functions of most "
                         "own time (rank 0)")
    ap.add_argument("--out", type=Path, default=None, help="results as JSON")
    args = ap.parse_args(argv)
    layouts = args.layouts.split(",")
    unknown = [k for k in layouts if k not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layout(s) {unknown}: expected {', '.join(LAYOUTS)}")
    try:
        counts = None if args.seqs is None else [int(x) for x in args.seqs.split(",")]
    except ValueError:
        ap.error(f"--seqs {args.seqs!r}: comma-separated integers")
    bad = [f"--{k.replace('_', '-')} {v}" for k, v in
           (("prompt", args.prompt), ("new_tokens", args.new_tokens))
           if v is not None and v < 1]
    bad += [f"--seqs {args.seqs}"] if counts is not None and min(counts) < 1 else []
    if args.profile_top < 0:
        bad.append(f"--profile-top {args.profile_top}")
    if bad:
        ap.error(f"{', '.join(bad)}: sizes must be >= 1, --profile-top >= 0")
    gpu = torch.cuda.device_count() >= 2
    counts = sorted(set(counts or [256 if gpu else 64]))
    seqs = counts[-1]
    prompt = args.prompt or (128 if gpu else 16)
    new = args.new_tokens or (64 if gpu else 16)
    if gpu:
        from .tp_gpu_bench import SHAPES as CONFIGS  # noqa: PLC0415
        from .tp_gpu_bench import random_weights  # noqa: PLC0415

        config = l3.ModelConfig.from_dict(CONFIGS[args.shape])

        def model_fn():
            return l3.Model(random_weights(config, backend="triton", device="cuda"))
        vocab, itemsize = config.vocab_size, 2
        what = f"{args.shape} shape, random bf16, {torch.cuda.get_device_name(0)}"
    else:
        torch.set_num_threads(1)
        model_fn, vocab, what = tiny_model, 4096, "tiny Llama fp32, CPU (gloo)"
        config, itemsize = tiny_model().config, 4
    prompts = workload(seqs, prompt, vocab)
    print(f"{what}: {', '.join(map(str, counts))} sequences, {prompt}-token prompts, "
          f"{new} new tokens"
          + (", prompts prefilled before the timed run" if args.prefill_first else ""),
          flush=True)
    rows: list[dict] = []
    first: dict[int, dict] = {}  # seqs -> the first layout's row (the ratios' base)
    pp_first: dict[int, dict] = {}  # seqs -> the first pipeline layout's row
    for key in layouts:
        try:
            runs = run_layout(key, model_fn, prompts, counts, new, gpu, args.prefill_first,
                              args.profile_top)
        except Exception as exc:  # one layout failing keeps the others'
            print(f"{key}: FAILED {type(exc).__name__}: {exc}", flush=True)
            continue
        for r in runs:
            n = r["seqs"]
            base = first.setdefault(n, r)
            r["vs_base"] = r["tok_s"] / base["tok_s"]
            r["decode_vs_base"] = r["decode_tok_s"] / base["decode_tok_s"]
            # (a decode step's mean context: the prompt and half the new tokens)
            r["pp2_floor"] = pp2_floor(config, n, prompt + new / 2, itemsize)
            r["vs"] = {base["layout"]: differences(base["tokens"], r["tokens"])}
            twin = pp_first.setdefault(n, r) if key.startswith("pp") else None
            if twin is not None and twin is not r:
                r["vs"][twin["layout"]] = differences(twin["tokens"], r["tokens"])
            print(f"{key} @ {n} seqs: {r['tok_s']:,.0f} tok/s ({r['vs_base']:.2f}x "
                  f"{base['layout']}); decode {r['decode_tok_s']:,.0f} tok/s "
                  f"({r['decode_vs_base']:.2f}x {base['layout']}, {r['decode_steps']} steps; "
                  f"PP=2's floor (W + KV)/(W + KV/2) {r['pp2_floor']:.2f}x); "
                  f"{r['steps']} steps, {r['ms_per_step']:.3f} ms/step, started in "
                  f"{r['startup_s']:.0f} s; tokens: "
                  + "; ".join(f"{words(d)} {other}" for other, d in r["vs"].items()), flush=True)
            if n == counts[-1]:
                print(format_summary(r["phases"]), flush=True)
            if r["profile"]:
                print(f"  own time under cProfile (us a step, {key} @ {n} seqs):\n" + "\n".join(
                    f"  {us:9.1f} {calls:8d}  {where}" for where, calls, us in r["profile"]),
                    flush=True)
            rows.append(r)
        if args.out is not None:
            args.out.write_text(json.dumps({"model": what, "seqs": counts, "prompt": prompt,
                                            "new_tokens": new, "torch": torch.__version__,
                                            "prefill_first": args.prefill_first,
                                            "rows": [{k: v for k, v in x.items() if k != "tokens"}
                                                     for x in rows]}, indent=2))
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
