"""Where one decode step of layer 4's engine goes: host stages, GPU kernels, GPU-idle fraction.

    python benchmarks/profile_engine.py [--seqs 256] [--steps 20] [--profile-steps 10]
                                        [--json out.json] [--no-to-end]
                                        [--async-scheduling auto|on|off] [--unfinished]
    python benchmarks/profile_engine.py --timeline [--json out.json]

Llama-3.2-1B's shape with random bf16 weights, nano-vllm's workload: `--seqs` requests,
prompts and outputs uniform in [--min-len, --max-len] tokens (EOS ignored, greedy). All
prompts are admitted and prefilled first; then decode-only steps (CUDA graphs) are timed:
wall time per step and each host stage (schedule, context, sample, postprocess, outputs;
under async scheduling `_complete` includes the wait for the previous step's tokens).
Steps are driven as generate() drives them (`step(unfinished=False)`; --unfinished: every
request's output each step, as layer 6's loop asks). Then `--profile-steps` steps run under
torch.profiler, each inside its own record_function range and with no sync between them:
per step, GPU busy time (the union of kernel and memcpy intervals inside the step's
wall-clock window) against wall time gives the GPU-idle fraction -- the host time the GPU
waits for -- and the same over the whole window of steps (`window_gpu_idle_fraction`; with
async scheduling a step's kernels run during the next step's window, so the window figure
is the one to read). Last,
unless --no-to-end, the workload runs to completion and every decode pass is counted by
batch size as replayed from a CUDA graph or run eagerly (the graph coverage).
Prints a short table; --json writes the same figures. --smoke: a tiny model on the CPU
(checks the script; no GPU figures).

--timeline: the whole workload instead (decode_prefill_engine.py's: seed 0, after its warm-up),
one CUDA event recorded on the stream before each step's launch and one after it (its
sampling and token copy included). The GPU reaches them in order, so per step: its span
(launch start to end on the GPU: kernels, plus any wait for an eager step's enqueue) and the
gap before it (the GPU idle with nothing queued: the host late between launches). Steps are
grouped (prefill = any chunk in the step; the first decode step after one; decode steps by
batch), each group against its roofline floor (the weights and its KV at copy bandwidth, or
its tokens' FLOPs at the bf16 rate): where the engine's time over its floor goes."""
from __future__ import annotations

import argparse
import collections
import json
import random
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

import layer3_model as l3
from layer0_hardware import timed_into
from layer4_algorithms import LLM, SamplingParams
from layer4_algorithms import cuda_graph_runner as CG
from layer4_algorithms import engine as E
from layer4_algorithms import launched_step as LS
from layer4_algorithms import model_runner as MR
from layer4_algorithms import scheduler as S
from layer4_algorithms.bench import engine as L4B
from layer4_algorithms.kv import paged_cache as PC

STAGES: collections.Counter = collections.Counter()
COVERAGE: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
_REPLAYED: list[bool] = [False]


def timed(cls, name: str) -> None:
    """Wrap cls.name so its host time adds up in STAGES[name]."""
    setattr(cls, name, timed_into(getattr(cls, name), lambda s: STAGES.update({name: s})))


def count_coverage() -> None:
    """Count every decode pass (all queries one token) by batch size: graph replay or eager."""
    # a pass runs through _run (eager, or the graph runner from inside it) unless the
    # runner's _graph_run replays it from the graphs first
    run, forward, replay = CG.CudaGraphRunner.run, MR.ModelRunner._run, MR.ModelRunner._graph_run

    def graph_run(self, *a, **k):
        _REPLAYED[0] = True
        return run(self, *a, **k)

    def counted_run(self, group, ids, ctx):
        _REPLAYED[0] = False
        result = forward(self, group, ids, ctx)
        if ctx.max_query_len == 1:
            COVERAGE[len(group)]["graph" if _REPLAYED[0] else "eager"] += 1
        return result

    def counted_replay(self, *a):
        result = replay(self, *a)
        if result is not None:  # (B, V) logits
            COVERAGE[result.shape[0]]["graph"] += 1
        return result
    CG.CudaGraphRunner.run, MR.ModelRunner._run = graph_run, counted_run
    MR.ModelRunner._graph_run = counted_replay


def union_within(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of intervals clipped to [lo, hi]."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    total, cur_a, cur_b = 0.0, None, None
    for a, b in clipped:
        if cur_b is None or a > cur_b:
            total += 0 if cur_b is None else cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    return total + (0 if cur_b is None else cur_b - cur_a)


def idle_per_step(events, prefix: str = "engine_step#") -> list[dict]:
    """From profiler events: each step range's wall time, GPU busy time within it and the
    GPU-idle fraction (None when no GPU activity was recorded at all, e.g. on a CPU)."""
    # the step ranges also appear on the GPU track (user annotations spanning their kernels):
    # neither a kernel nor a second step
    gpu = [(e.time_range.start, e.time_range.end) for e in events
           if e.device_type == DeviceType.CUDA and not e.name.startswith(prefix)
           and e.name != "engine_drain"]
    steps = sorted((e for e in events
                    if e.name.startswith(prefix) and e.device_type == DeviceType.CPU),
                   key=lambda e: e.time_range.start)
    out = []
    for e in steps:
        lo, hi = e.time_range.start, e.time_range.end
        busy = union_within(gpu, lo, hi) if gpu else None
        out.append({"step": e.name, "wall_ms": (hi - lo) / 1e3,
                    "gpu_busy_ms": None if busy is None else busy / 1e3,
                    "gpu_idle_fraction": None if busy is None else 1 - busy / max(hi - lo, 1e-9),
                    "batch": None})
    return out


def window_idle(events, steps: list[dict], prefix: str = "engine_step#") -> dict:
    """GPU busy vs wall over all profiled steps at once, from the first step's start to the
    end of the GPU work they queued (the drain after them): with async scheduling a step's
    kernels run while the host is in the next step's range."""
    gpu = [(e.time_range.start, e.time_range.end) for e in events
           if e.device_type == DeviceType.CUDA and not e.name.startswith(prefix)
           and e.name != "engine_drain"]
    marks = [e for e in events if e.device_type == DeviceType.CPU
             and (e.name.startswith(prefix) or e.name == "engine_drain")]
    if not gpu or not marks:
        return {"wall_ms": None, "gpu_busy_ms": None, "gpu_idle_fraction": None,
                "steps": len(steps)}
    lo = min(e.time_range.start for e in marks)
    hi = max(e.time_range.end for e in marks)
    busy = union_within(gpu, lo, hi)
    return {"wall_ms": (hi - lo) / 1e3, "gpu_busy_ms": busy / 1e3,
            "gpu_idle_fraction": 1 - busy / max(hi - lo, 1e-9), "steps": len(steps)}


def build(args: argparse.Namespace) -> tuple[LLM, str]:
    shape, dev, dtype = dict(l3.LLAMA_3_2_1B), "cuda", torch.bfloat16
    if args.smoke:
        shape.update(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        dev, dtype = "cpu", torch.float32
    net = l3.random_model(l3.ModelConfig.from_dict(shape), backend="triton", dtype=dtype,
                          device=dev)
    mode = {"auto": None, "on": True, "off": False}[args.async_scheduling]
    llm = LLM(l3.Model(net, None), max_num_seqs=args.seqs, block_size=16,
              max_num_batched_tokens=8192, cuda_graph=True, async_scheduling=mode,
              max_model_len=2 * args.max_len + 64, num_blocks=None if dev == "cuda" else 40000)
    rng = random.Random(0)
    for i in range(args.seqs):  # nano-vllm's workload: prompt and output lengths uniform
        prompt = [rng.randrange(1000, 100000) for _ in range(rng.randint(args.min_len,
                                                                         args.max_len))]
        out_len = rng.randint(args.min_len, args.max_len)
        llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=out_len,
                                               ignore_eos=True), str(i))
    return llm, dev


class Timeline:
    """Per launched step: CUDA events before and after `LLM._launch` (on a CPU: none), the
    step's shape and the host's time in the launch and in the whole step() call."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.rows, self.steps, self.reads = cuda, [], [], []
        self._launch, self._step, self._read = E.LLM._launch, E.LLM.step, LS.LaunchedStep.read

    def __enter__(self) -> Timeline:
        timeline, launch, step, read = self, self._launch, self._step, self._read

        def timed_launch(llm, out, *a, **k):
            begin = timeline._event()
            t0 = time.perf_counter()
            result = launch(llm, out, *a, **k)
            host = time.perf_counter() - t0
            chunks = [s for s in out.scheduled if s.query_len > 1]
            decodes = [s for s in out.scheduled if s.query_len == 1]
            timeline.rows.append({
                "begin": begin, "end": timeline._event(), "host_launch_s": host,
                "step_index": len(timeline.steps), "seqs": len(out.scheduled),
                "prefill_tokens": sum(s.query_len for s in chunks),
                "prefill_attended": sum(s.query_len * (s.context_len + s.query_len / 2)
                                        for s in chunks),
                "decodes": len(decodes),
                "decode_context": sum(s.context_len + 1 for s in decodes)})
            return result

        def timed_step(llm, *a, **k):
            t0 = time.perf_counter()
            try:
                return step(llm, *a, **k)
            finally:
                timeline.steps.append(time.perf_counter() - t0)

        def timed_read(launched):
            t0 = time.perf_counter()
            try:
                return read(launched)
            finally:
                timeline.reads.append((len(timeline.steps), time.perf_counter() - t0))
        E.LLM._launch, E.LLM.step, LS.LaunchedStep.read = timed_launch, timed_step, timed_read
        return self

    def __exit__(self, *exc) -> None:
        E.LLM._launch, E.LLM.step, LS.LaunchedStep.read = self._launch, self._step, self._read

    def host_ms(self) -> list[float]:
        """Per step() call: its wall time minus the time in reading tokens (the waits)."""
        host = [s * 1e3 for s in self.steps]
        for i, r in self.reads:
            if i < len(host):
                host[i] -= r * 1e3
        return host

    def _event(self):
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev


def timeline_groups(rows: list[dict], net, bw: float, peak: float,
                    host_ms: list[float]) -> dict[str, dict]:
    """Each launched step's span and preceding gap on the GPU (ms; None on a CPU), its
    floor, grouped: "prefill" (a chunk in the step), "first decode" (the first decode-only
    step after a prefill), "decode B<=32" / "B<=128" / "B>128" by batch; host_ms: each
    step() call's host time (Timeline.host_ms), counted for the launch made in it."""
    cfg, wbytes = net.config, l3.weight_bytes(net)
    params = wbytes / net.dtype.itemsize
    kv_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim \
        * net.dtype.itemsize
    attn_flops = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    groups: dict[str, dict] = {}
    after_prefill = False
    for i, r in enumerate(rows):
        span = gap = None
        if r["begin"] is not None:
            span = r["begin"].elapsed_time(r["end"])
            gap = rows[i - 1]["end"].elapsed_time(r["begin"]) if i else 0.0
        tokens = r["prefill_tokens"] + r["decodes"]
        flops = 2 * params * tokens + attn_flops * r["prefill_attended"]
        moved = wbytes + kv_token * (r["decode_context"] + r["prefill_attended"] /
                                     max(r["prefill_tokens"], 1))
        floor = max(flops / peak, moved / bw) * 1e3
        if r["prefill_tokens"]:
            name, after_prefill = "prefill", True
        elif after_prefill:
            name, after_prefill = "first decode", False
        else:
            b = r["decodes"]
            name = "decode B<=32" if b <= 32 else "decode B<=128" if b <= 128 else "decode B>128"
        g = groups.setdefault(name, {"steps": 0, "span_ms": 0.0, "gap_ms": 0.0, "floor_ms": 0.0,
                                     "host_launch_ms": 0.0, "host_step_ms": 0.0, "tokens": 0})
        g["steps"] += 1
        g["span_ms"] += span or 0.0
        g["gap_ms"] += gap or 0.0
        g["floor_ms"] += floor
        g["host_launch_ms"] += r["host_launch_s"] * 1e3
        if r["step_index"] < len(host_ms):
            g["host_step_ms"] += host_ms[r["step_index"]]
        g["tokens"] += tokens
    return groups


def run_timeline(args: argparse.Namespace) -> dict:
    """--timeline: the whole workload once, after the warm-up, each step's span and gap on
    the GPU; a table by group, totals against the roofline floor."""
    shape, dev, dtype = dict(l3.LLAMA_3_2_1B), "cuda", torch.bfloat16
    seqs, lo, hi = args.seqs, args.min_len, args.max_len
    if args.smoke:
        shape.update(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=512)
        dev, dtype, seqs, lo, hi = "cpu", torch.float32, 6, 4, 16
    net = l3.random_model(l3.ModelConfig.from_dict(shape), backend="triton", dtype=dtype,
                          device=dev)
    bw, peak = (1e11, 1e11) if args.smoke else (lambda c: (c.memory_bandwidth,
                                                            c.flops["bf16"]))(
        l3.load_ceilings("cuda"))
    wl = L4B.random_workload(seqs, lo, hi, net.config.vocab_size)
    mode = {"auto": None, "on": True, "off": False}[args.async_scheduling]
    llm = LLM(l3.Model(net, None), max_num_seqs=seqs, block_size=16,
              max_num_batched_tokens=8192, cuda_graph=not args.smoke, async_scheduling=mode,
              max_model_len=2 * hi + 64, num_blocks=None if dev == "cuda" else 512)
    with torch.no_grad():
        L4B.warm_up(llm, wl)
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        sync()
        with Timeline(dev == "cuda") as tl:
            t0 = time.perf_counter()
            llm.generate(wl.prompts, wl.params())
            sync()
            wall = time.perf_counter() - t0
    groups = timeline_groups(tl.rows, net, bw, peak, tl.host_ms())
    floor = L4B.roofline_floor_s(net, wl, seqs, bw, peak)
    print(f"whole workload: {wl.output_tokens / wall:,.0f} tok/s, {wall:.3f} s, "
          f"{len(tl.rows)} launches, {len(tl.steps)} step() calls, host in step() "
          f"{sum(tl.steps):.3f} s; roofline floor {floor:.3f} s = {floor / wall:.1%}")
    print(f"{'group':14s} {'steps':>6} {'span ms':>9} {'gap ms':>8} {'floor ms':>9} "
          f"{'span/floor':>10} {'host launch ms':>14} {'host step ms':>12} {'tokens':>8}")
    for name, g in groups.items():
        print(f"{name:14s} {g['steps']:6d} {g['span_ms']:9.1f} {g['gap_ms']:8.1f} "
              f"{g['floor_ms']:9.1f} {g['span_ms'] / max(g['floor_ms'], 1e-9):10.2f} "
              f"{g['host_launch_ms']:14.1f} {g['host_step_ms']:12.1f} {g['tokens']:8d}")
    span = sum(g["span_ms"] for g in groups.values())
    gap = sum(g["gap_ms"] for g in groups.values())
    print(f"GPU timeline: spans {span:.1f} ms + gaps {gap:.1f} ms of {wall * 1e3:.1f} ms wall")
    worst = sorted(((r["begin"].elapsed_time(r["end"]) if r["begin"] is not None else 0.0,
                     i) for i, r in enumerate(tl.rows)), reverse=True)[:8]
    for ms, i in worst:
        r = tl.rows[i]
        print(f"  longest span: step {i} {ms:.2f} ms, {r['prefill_tokens']} prefill tokens, "
              f"{r['decodes']} decodes, host launch {r['host_launch_s'] * 1e3:.2f} ms")
    result = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
              "async_scheduling": llm.config.async_scheduling, "seconds": wall,
              "tokens_per_s": wl.output_tokens / wall, "roofline_floor_s": floor,
              "roofline_fraction": floor / wall, "launches": len(tl.rows),
              "host_step_s": sum(tl.steps), "groups": groups,
              "per_step": [{k: v for k, v in r.items() if k not in ("begin", "end")}
                           | ({"span_ms": r["begin"].elapsed_time(r["end"]),
                               "gap_ms": tl.rows[i - 1]["end"].elapsed_time(r["begin"])
                               if i else 0.0} if r["begin"] is not None else {})
                           for i, r in enumerate(tl.rows)]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per stage")
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--no-to-end", dest="to_end", action="store_false",
                    help="skip running the workload to completion (graph coverage)")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                    help="EngineConfig.async_scheduling (auto: on for CUDA)")
    ap.add_argument("--unfinished", action="store_true",
                    help="step() returns every request's output (layer 6's way)")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny model on the CPU: checks the script runs")
    ap.add_argument("--timeline", action="store_true",
                    help="the whole workload: each step's span and gap on the GPU, by group")
    args = ap.parse_args(argv)
    if args.timeline:
        return run_timeline(args)
    wrapped = [(S.Scheduler, "schedule"), (S.Scheduler, "postprocess"),
               (PC.PagedKVCache, "context"), (MR.ModelRunner, "input_ids"),
               (MR, "decode_inputs"), (MR.ModelRunner, "place_ids"),
               (MR.ModelRunner, "sample"), (MR.ModelRunner, "sample_tokens"),
               (MR.ModelRunner, "execute"), (E.LLM, "_launch"), (E.LLM, "_complete"),
               (E.LLM, "_outputs")]
    originals = [(c, n, getattr(c, n)) for c, n in
                 wrapped + [(CG.CudaGraphRunner, "run"), (MR.ModelRunner, "_run"),
                            (MR.ModelRunner, "_graph_run")]]
    for cls, name in wrapped:
        timed(cls, name)
    count_coverage()
    try:
        return _profile(args)
    finally:  # the engine's classes as they were: a test calls main() in pytest's process
        for cls, name, f in originals:
            setattr(cls, name, f)
        STAGES.clear()
        COVERAGE.clear()


def _profile(args: argparse.Namespace) -> dict:
    llm, dev = build(args)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    sched = llm.scheduler

    def step() -> None:
        llm.step(unfinished=args.unfinished)

    while sched.waiting or any(s.num_uncomputed_tokens > 1 for s in sched.running):
        step()
    print(f"{len(sched.running)} sequences decoding after {llm.stats.steps} steps "
          f"(async_scheduling={llm.config.async_scheduling})")
    for _ in range(3):
        step()
    sync()
    STAGES.clear()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    wall = (time.perf_counter() - t0) / args.steps
    print(f"wall {wall * 1e3:.2f} ms per decode step at batch {len(sched.running)}")
    stages = {k: v / args.steps * 1e3 for k, v in STAGES.most_common()}
    for k, v in stages.items():
        print(f"  {k:12s} {v:7.2f} ms/step")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    batches = []
    with profile(activities=activities) as prof:
        for i in range(args.profile_steps):  # no sync between steps: the overlap is measured
            batches.append(len(sched.running))
            with record_function(f"engine_step#{i}"):
                step()
        with record_function("engine_drain"):
            sync()
    events = prof.events()
    steps = idle_per_step(events)
    for s, b in zip(steps, batches, strict=False):
        s["batch"] = b
    _print_steps(steps)
    window = window_idle(events, steps)
    if window["gpu_idle_fraction"] is not None:
        print(f"window of {len(steps)} steps: {window['wall_ms']:.2f} ms wall, "
              f"{window['gpu_busy_ms']:.2f} ms GPU busy, "
              f"GPU idle {window['gpu_idle_fraction']:.0%}")
    kernels = _top_kernels(prof, args.profile_steps)
    if args.to_end:
        while llm.has_unfinished():
            step()
    coverage = {b: dict(c) for b, c in sorted(COVERAGE.items())}
    _print_coverage(coverage)
    result = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
              "async_scheduling": llm.config.async_scheduling,
              "unfinished_outputs": args.unfinished, "window": window,
              "seqs": args.seqs, "lengths": [args.min_len, args.max_len],
              "wall_ms_per_step": wall * 1e3, "stages_ms_per_step": stages, "steps": steps,
              "mean_gpu_idle_fraction": _mean([s["gpu_idle_fraction"] for s in steps]),
              "graph_coverage": coverage, "top_kernels": kernels,
              "decode_passes": sum(sum(c.values()) for c in coverage.values()),
              "eager_decode_passes": sum(c.get("eager", 0) for c in coverage.values())}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return result


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _print_steps(steps: list[dict]) -> None:
    print(f"{'step':>5} {'batch':>5} {'wall ms':>8} {'GPU busy ms':>11} {'GPU idle':>8}")
    for i, s in enumerate(steps):
        busy = "n/a" if s["gpu_busy_ms"] is None else f"{s['gpu_busy_ms']:.2f}"
        idle = "n/a" if s["gpu_idle_fraction"] is None else f"{s['gpu_idle_fraction']:.0%}"
        print(f"{i:5d} {s['batch']:5d} {s['wall_ms']:8.2f} {busy:>11} {idle:>8}")
    m = _mean([s["gpu_idle_fraction"] for s in steps])
    print("mean GPU-idle fraction per step: " + ("n/a (no GPU)" if m is None else f"{m:.0%}"))


def _print_coverage(coverage: dict) -> None:
    eager = {b: c["eager"] for b, c in coverage.items() if c.get("eager")}
    total = sum(sum(c.values()) for c in coverage.values())
    print(f"CUDA-graph coverage: {total - sum(eager.values())} of {total} decode passes replayed "
          f"over {len(coverage)} batch sizes; eager at batch sizes: "
          + (", ".join(f"{b} ({n}x)" for b, n in list(eager.items())[:20]) or "none"))


def _top_kernels(prof, n_steps: int) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))
    gpu = sum(getattr(e, "self_device_time_total", 0) for e in rows)
    print(f"GPU kernel time {gpu / max(n_steps, 1) / 1e3:.2f} ms per step")
    out = []
    for e in rows[:15]:
        t = getattr(e, "self_device_time_total", 0)
        if t:
            out.append({"us_per_step": t / n_steps, "count_per_step": e.count / n_steps,
                        "name": e.key[:100]})
            print(f"{t / n_steps:9.1f} us/step  {e.count / n_steps:6.1f}x  {e.key[:100]}")
    return out


if __name__ == "__main__":
    main()
