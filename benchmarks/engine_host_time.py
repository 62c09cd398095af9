"""Layer 4's host time per decode step: `LLM.step()`'s CPU time minus the forward and sampling.

    python benchmarks/engine_host_time.py [--batch 32] [--new-tokens 64] [--repeats 5]
                                          [--profile 30] [--stages] [--no-text] [--graphs]
    python benchmarks/engine_host_time.py --prefill 2048 [--repeats 5] [--profile 30]
    python benchmarks/engine_host_time.py --prefill 2048 --timeline [--calls 30] [--cuda]

A tiny random Llama-shaped model (2 layers, hidden 64) with the course tokenizer (vocab 4096:
every sampled token is detokenised, as in real serving), on the CPU, so the forward pass costs
little and what is left is the engine's own Python: scheduling, block tables, input
preparation, sampling bookkeeping, appending tokens, stop checks, detokenisation, outputs.
`--batch` requests of 16-token prompts are admitted and prefilled; then the decode steps
(EOS ignored, greedy) are timed one by one: host time = step()'s time - the time inside
the network's forward and the sampling's argmax (what a GPU runs), both as this thread's CPU
time (time.thread_time: what other processes on a shared machine do to the wall clock is
left out; the forward runs on this thread, torch.set_num_threads(1)). Printed per mode (sync /
async scheduling; generate()'s step(unfinished=False), and layer 6's step(unfinished=True,
delta=True), every request's new tokens every step):
the median over --repeats runs
of each run's median host microseconds per decode step. --profile N: cProfile of N decode
steps (async, unfinished=False), the top functions by own time. --graphs: the decode steps go
through layer 4's CUDA-graph runner run eagerly (capture=False): the GPU's decode path (one-pass
inputs, the static buffers filled from the host, the graph's logits buffer) with the bucket's
step timed as the forward (on a GPU: one graph replay).

--prefill N: the host time of `LLM.generate([prompt], max_tokens=1)` for one fresh N-token
prompt (token ids, greedy; max_num_batched_tokens N, one sequence, async scheduling as on a GPU),
its one step through layer 4's prefill-graph runner run eagerly (capture=False) with the replay a
stub (the forward and the graph's logits: what the GPU runs), so all that is left is the host's:
request intake, scheduling, the step's inputs (token list, positions, slots, block tables),
sampling's launch, reading the token, the outputs. This thread's CPU time (thread_time: other
processes on a shared machine left out) per call, median of --repeats runs of 20 calls each,
split at the replay: before it (the GPU idles: all of it is on the prefill's wall clock) and
after it (on a GPU partly hidden behind the replay; what follows the token's read is not), and
by phase.

--timeline (with --prefill N): the same call's timeline in WALL time (perf_counter, what the
prefill's latency sees: a wait, a page fault or another thread's turn included) beside this
thread's CPU time: the entry and exit of the engine's methods (gc's freeze calls and passes
too), in microseconds from generate()'s call, each the median over --calls calls a clock
(alternate calls read one clock or the other: one read a stamp; each wrapper adds ~1 us).
Where the wall column grows faster than the thread column the thread did not run (waiting:
a blocking call, the GIL, the scheduler); the thread column is rough (a thread_time read costs
~0.7 us here: taken off). "the caller's next line": the previous call's result, freed when
`out = llm.generate(...)` rebinds it. --cuda: on a GPU instead, decode_prefill_engine.py's 1B
engine with its prefill graphs (torch.cuda.Event's record, query, synchronize stamped too).
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import pstats
import statistics
import time
from pathlib import Path

import torch

import layer3_model as l3
from layer0_hardware import timed_into
from layer4_algorithms import (
    LLM,
    CudaGraphRunner,
    SamplingParams,
    engine,
    launched_step,
    model_runner,
    scheduler,
)
from layer4_algorithms.kv import block_manager, paged_cache
from layer4_algorithms.prefill_graph_runner import PrefillGraphRunner

ROOT = Path(__file__).resolve().parents[1]


def tiny_model(text: bool = True) -> l3.Model:
    tok = l3.Tokenizer.from_pretrained(ROOT / "models" / "course-target") if text else None
    cfg = l3.ModelConfig(model_type="llama", vocab_size=4096, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    return l3.Model(l3.random_model(cfg, seed=0), tok)


class ForwardTimer:
    """Wraps the network's forward and torch's argmax (an all-greedy step's sampling kernel):
    the seconds spent inside them since the last reset, what a GPU would run."""

    def __init__(self, net: torch.nn.Module) -> None:
        self.seconds = 0.0
        net.forward = timed_into(net.forward, self.add, time.thread_time)
        torch.Tensor.argmax = timed_into(torch.Tensor.argmax, self.add, time.thread_time)

    def add(self, seconds: float) -> None:
        self.seconds += seconds


# --stages: host stages of the decode steps (thread CPU seconds), the forward and argmax excluded
# (a decode step's ids, lengths and table rows: decode_inputs in one pass, then place_ids;
# other steps: the runner's input_ids and the mirror's gather)
STAGES = [(scheduler.Scheduler, "schedule"), (model_runner, "decode_inputs"),
          (model_runner.ModelRunner, "place_ids"), (paged_cache.PagedKVCache, "context"),
          (engine.LLM, "_sampling_rows"), (launched_step.LaunchedStep, "on_device"),
          (launched_step.LaunchedStep, "read"), (scheduler.Scheduler, "postprocess"),
          (engine.LLM, "_outputs")]
STAGE_S: collections.Counter = collections.Counter()
COUNTING = [False]


def time_stages() -> None:
    for cls, name in STAGES:
        def add(seconds: float, name: str = name) -> None:
            if COUNTING[0]:
                STAGE_S[name] += seconds
        setattr(cls, name, timed_into(getattr(cls, name), add, time.thread_time))


def eager_graphs(llm: LLM, timer: ForwardTimer) -> None:
    """The runner's decode steps through a CudaGraphRunner run eagerly; the whole of each
    bucket's step counts as the forward (what one replay launches on a GPU)."""
    cfg = llm.config
    graph = CudaGraphRunner(llm.model.net, llm.cache, cfg.max_num_seqs,
                            -(-cfg.resolved_max_model_len // llm.cache.block_size),
                            capture=False)
    inner = graph._step

    def step(bucket: int) -> None:
        t, before = time.thread_time(), timer.seconds
        inner(bucket)
        timer.seconds = before + time.thread_time() - t  # (its forward is inside)
    graph._step = step
    llm.runner.graph = graph


def run(model: l3.Model, timer: ForwardTimer, batch: int, new_tokens: int, async_on: bool,
        unfinished: bool, profiler: cProfile.Profile | None = None,
        graphs: bool = False) -> list[float]:
    """Host microseconds of each decode step of one batch."""
    llm = LLM(model, num_blocks=batch * 8 + 8, block_size=16, max_num_seqs=batch,
              max_num_batched_tokens=max(2048, batch * 16), async_scheduling=async_on)
    if graphs:
        eager_graphs(llm, timer)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        llm.add_request([(7 * i + j) % 4000 + 50 for j in range(16)], params)
    host = []
    while llm.has_unfinished():
        decode = all(not s.num_uncomputed_tokens > 1 for s in llm.scheduler.running) \
            and not llm.scheduler.waiting and llm.scheduler.running
        timer.seconds = 0.0
        COUNTING[0] = bool(decode)
        if decode and profiler is not None:
            profiler.enable()
        t = time.thread_time()
        llm.step(unfinished=unfinished, delta=unfinished)  # as generate() / layer 6 ask
        wall = time.thread_time() - t
        if decode and profiler is not None:
            profiler.disable()
        if decode:
            host.append((wall - timer.seconds) * 1e6)
    COUNTING[0] = False
    llm.drain()
    return host[2:]  # the first decode steps still read first tokens


# --prefill: the phases of one prefill call, each the time inside its function (inclusive)
PREFILL_PHASES = [("intake", engine.LLM, "add_request"),
                  ("schedule", scheduler.Scheduler, "schedule"),
                  ("step inputs", model_runner.ModelRunner, "execute"),
                  ("graph inputs", PrefillGraphRunner, "run"),
                  ("sampling launch", engine.LLM, "_sample_launch"),
                  ("read + postprocess", engine.LLM, "_complete"),
                  ("outputs", engine.LLM, "_outputs")]


def prefill_engine(tokens: int, on_replay) -> tuple[LLM, int]:
    """An engine whose `tokens`-token prefills go through layer 4's prefill-graph runner run
    eagerly, the replay a stub that calls on_replay() (the GPU's work: one graph launch), and
    the model's vocabulary size."""
    cfg = l3.ModelConfig(model_type="llama", vocab_size=4096, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=2 * tokens)
    net = l3.random_model(cfg, seed=0, backend="triton")  # (flash path: what the graphs need)
    llm = LLM(l3.Model(net, None), max_num_seqs=1, max_num_batched_tokens=tokens,
              max_model_len=tokens + 16, num_blocks=-(-tokens // 16) * 2 + 8,
              async_scheduling=True)
    graphs = PrefillGraphRunner(net, llm.cache, tokens, llm.runner.tables.table.shape[1],
                                capture=False)
    graphs._step = lambda _bucket, _kind: on_replay()
    llm.runner.prefill_graph = graphs
    return llm, cfg.vocab_size


def prefill_host(tokens: int, repeats: int, profile: int = 0, calls: int = 20) -> dict:
    """Host microseconds of one `tokens`-token prefill through generate (module docstring):
    {"total", "before_replay", "after_replay", phase name: ...}, each the median over `repeats`
    runs of the median of `calls` calls; "step inputs" is execute() less the graph runner's
    run, "graph inputs" run() less the replay stub."""
    marks: dict[str, float] = collections.defaultdict(float)
    llm, vocab = prefill_engine(tokens, lambda: marks.__setitem__("replay_at", time.thread_time()))
    wrapped = []
    for name, cls, attr in PREFILL_PHASES:
        def add(seconds: float, name: str = name) -> None:
            marks[name] += seconds
        owner = next(c for c in cls.__mro__ if attr in c.__dict__)  # (a mixin's method)
        inner = owner.__dict__[attr]
        setattr(owner, attr, timed_into(inner, add, time.thread_time))
        wrapped.append((owner, attr, inner))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)

    def one() -> dict[str, float]:
        prompt = torch.randint(0, vocab, (tokens,), generator=gen).tolist()
        marks.clear()
        t0 = time.thread_time()
        out = llm.generate([prompt], params)
        end = time.thread_time()
        if len(out[0].outputs[0].token_ids) != 1 or "replay_at" not in marks:
            raise RuntimeError("the prefill did not go through the graph runner to one token")
        got = {"total": end - t0, "before_replay": marks["replay_at"] - t0,
               "after_replay": end - marks["replay_at"]}
        got.update({name: marks[name] for name, _, _ in PREFILL_PHASES})
        got["step inputs"] -= got["graph inputs"]
        return got
    try:
        for _ in range(5):
            one()  # warm-up
        runs = []
        for _ in range(repeats):
            got = [one() for _ in range(calls)]
            runs.append({k: statistics.median(g[k] for g in got) * 1e6 for k in got[0]})
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(profile):
                one()
            prof.disable()
            pstats.Stats(prof).sort_stats("cumtime").print_stats(40)
    finally:
        for cls, attr, inner in wrapped:
            setattr(cls, attr, inner)
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


# --timeline: the methods stamped at entry and exit, in the order a lone prefill calls them
TIMELINE = [(engine.LLM, "generate"), (engine.LLM, "reset_stats"), (engine.LLM, "add_request"),
            (engine.LLM, "step"), (engine.LLM, "_advance"), (scheduler.Scheduler, "schedule"),
            (model_runner.ModelRunner, "execute"), (PrefillGraphRunner, "run"),
            (engine.LLM, "_sample_launch"), (launched_step.LaunchedStep, "on_gpu"),
            (block_manager.BlockManager, "drain"), (engine.LLM, "_complete"),
            (launched_step.LaunchedStep, "read_tokens"), (launched_step.LaunchedStep, "read"),
            (scheduler.Scheduler, "postprocess"), (engine.LLM, "_end_step"),
            (engine.LLM, "_outputs"), (engine.LLM, "drain"), (gc, "get_freeze_count"),
            (gc, "freeze"), (gc, "unfreeze")]
CUDA_TIMELINE = [(torch.cuda.Event, "record"), (torch.cuda.Event, "query"),
                 (torch.cuda.Event, "synchronize")]


def cuda_prefill_engine(tokens: int) -> tuple[LLM, int, object]:
    """decode_prefill_engine.py's engine_prefill engine on the GPU (the 1B shape, random
    weights, CUDA graphs with the prefill graphs), its vocabulary size and device sync."""
    import decode_prefill_engine as bench  # (beside this script)
    net, _, _ = bench._setup(False)
    llm = LLM(l3.Model(net, None), max_num_seqs=1, max_num_batched_tokens=tokens,
              prefill_attention=net.prefill_attention, max_model_len=tokens + 16,
              num_blocks=-(-tokens // 16) * 2 + 8, cuda_graph=True, prefill_cuda_graph=True)
    return llm, net.config.vocab_size, bench.device_sync


def prefill_timeline(tokens: int, calls: int, cuda: bool = False
                     ) -> list[tuple[float, float, str]]:
    """(wall us, thread us, label) of each stamp of one `tokens`-token prefill through
    generate (module docstring; cuda: on the GPU, cuda_prefill_engine), medians over `calls`
    calls of each clock (alternate calls stamp perf_counter and thread_time: one clock read a
    stamp, its own cost, measured here, taken off each stamp after it), after 6 warm-ups. The
    caller holds each call's result until the next call's returns, as decode_prefill_engine.py
    did (`out = llm.generate(...)`): "the caller's next line" shows what freeing it costs."""
    stamps: list[tuple[str, float]] = []
    clock = [time.perf_counter]

    def stamp(label: str) -> None:
        stamps.append((label, clock[0]()))

    if cuda:
        llm, vocab, sync = cuda_prefill_engine(tokens)
    else:
        llm, vocab = prefill_engine(tokens, lambda: stamp("replay (stub)"))
        sync = lambda: None  # noqa: E731
    wrapped = []
    for cls, attr in TIMELINE + (CUDA_TIMELINE if cuda else []):
        owner = cls if cls is gc else next(c for c in cls.__mro__ if attr in c.__dict__)
        inner = getattr(owner, attr) if cls is gc else owner.__dict__[attr]
        name = f"{getattr(cls, '__name__', cls)}.{attr}"

        def outer(*a, _f=inner, _in=name + " in", _out=name + " out", **k):
            stamps.append((_in, clock[0]()))
            try:
                return _f(*a, **k)
            finally:
                stamps.append((_out, clock[0]()))
        setattr(owner, attr, outer)
        wrapped.append((owner, attr, inner))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    per: dict[tuple[str, str], list[float]] = collections.defaultdict(list)

    def collected(phase: str, info: dict) -> None:  # the garbage collector's passes
        stamp(f"gc collect gen{info['generation']} {phase}")
    gc.callbacks.append(collected)
    cost = {}
    for c in (time.perf_counter, time.thread_time):
        t = time.perf_counter()
        for _ in range(1000):
            c()
        cost[c] = (time.perf_counter() - t) / 1000
    out = None
    try:
        for i in range(2 * calls + 6):
            clock[0] = time.thread_time if i % 2 else time.perf_counter
            prompt = torch.randint(0, vocab, (tokens,), generator=gen).tolist()
            sync()
            stamps.clear()
            t0 = clock[0]()
            out = llm.generate([prompt], params)  # (the previous call's result freed here)
            stamp("the caller's next line")
            sync()
            if i < 6:
                continue
            if len(out[0].outputs[0].token_ids) != 1:
                raise RuntimeError("the prefill did not sample one token")
            seen: collections.Counter = collections.Counter()
            for j, (label, t) in enumerate(stamps):
                seen[label] += 1
                key = f"{label}#{seen[label]}" if seen[label] > 1 else label
                per[(key, "thread" if i % 2 else "wall")].append(
                    (t - t0 - (j + 1) * cost[clock[0]]) * 1e6)
    finally:
        gc.callbacks.remove(collected)
        for owner, attr, inner in wrapped:
            setattr(owner, attr, inner)
    del out
    rows = []
    for key in {k for k, _ in per}:
        wall, cpu = per.get((key, "wall"), []), per.get((key, "thread"), [])
        seen_in = min(len(wall), len(cpu))
        rows.append((statistics.median(wall) if wall else float("nan"),
                     statistics.median(cpu) if cpu else float("nan"),
                     key + (f" (in {seen_in} of {calls} calls)" if seen_in < calls else "")))
    return sorted(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-text", action="store_true",
                    help="a model without a tokenizer (no detokenisation: bench.dp's workload)")
    ap.add_argument("--profile", type=int, default=0, help="cProfile this many runs' decode steps")
    ap.add_argument("--graphs", action="store_true",
                    help="decode through the CUDA-graph runner, run eagerly (the GPU's path)")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="the host time of one N-token prefill through generate, by phase")
    ap.add_argument("--timeline", action="store_true",
                    help="with --prefill: the call's wall-clock timeline, method by method")
    ap.add_argument("--calls", type=int, default=30,
                    help="--timeline: the calls measured (each clock)")
    ap.add_argument("--cuda", action="store_true",
                    help="--timeline on the GPU: decode_prefill_engine.py's 1B engine, graphs on")
    ap.add_argument("--stages", action="store_true",
                    help="also the host time per decode step of each stage (async, generate)")
    args = ap.parse_args()
    for name in ("batch", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.profile < 0:
        ap.error(f"--profile must be >= 0, got {args.profile}")
    if args.prefill < 0:
        ap.error(f"--prefill must be >= 0, got {args.prefill}")
    if args.timeline and not args.prefill:
        ap.error("--timeline needs --prefill N")
    if args.cuda and not (args.timeline and torch.cuda.is_available()):
        ap.error("--cuda needs --timeline and a GPU")
    if args.calls < 1:
        ap.error(f"--calls must be >= 1, got {args.calls}")
    torch.set_num_threads(1)
    if args.timeline:
        where = (f"{torch.cuda.get_device_name()}, the 1B shape's prefill graphs" if args.cuda
                 else "CPU, the prefill-graph runner with the replay a stub")
        print(f"timeline of one {args.prefill}-token prefill (generate, max_tokens 1), {where}, "
              f"torch {torch.__version__}: us from generate's call, medians of {args.calls} "
              f"calls a clock", flush=True)
        print(f"  {'wall':>8} {'thread':>8} {'wall-thread':>11}", flush=True)
        for wall, cpu, label in prefill_timeline(args.prefill, args.calls, args.cuda):
            print(f"  {wall:8.1f} {cpu:8.1f} {wall - cpu:11.1f}  {label}", flush=True)
        return
    if args.prefill:
        got = prefill_host(args.prefill, args.repeats, args.profile)
        print(f"engine host time of one {args.prefill}-token prefill (generate, max_tokens 1, "
              f"prefill-graph runner with the replay a stub), CPU, torch {torch.__version__}: "
              f"{got['total']:.0f} us, {got['before_replay']:.0f} before the replay, "
              f"{got['after_replay']:.0f} after", flush=True)
        print("  phases (us): " + ", ".join(f"{name} {got[name]:.0f}"
                                            for name, _, _ in PREFILL_PHASES), flush=True)
        return
    model = tiny_model(text=not args.no_text)
    timer = ForwardTimer(model.net)
    g = args.graphs
    run(model, timer, args.batch, 8, True, False, graphs=g)  # warm up
    print(f"engine host time per decode step, batch {args.batch}, {args.new_tokens} new tokens, "
          f"tiny random model (2 layers, hidden 64, vocab 4096), CPU, torch {torch.__version__}"
          + (", decode through the graph runner (eager)" if g else ""), flush=True)
    for async_on in (False, True):
        for unfinished in (False, True):
            meds = [statistics.median(run(model, timer, args.batch, args.new_tokens, async_on,
                                          unfinished, graphs=g)) for _ in range(args.repeats)]
            mode = "server (delta outputs)" if unfinished else "generate"
            print(f"  {'async' if async_on else 'sync '} {mode:22}: "
                  f"{statistics.median(meds):5.0f} us/step host, best run {min(meds):.0f} "
                  f"(runs: {', '.join(f'{m:.0f}' for m in meds)})", flush=True)
    if args.stages:
        time_stages()
        steps = sum(len(run(model, timer, args.batch, args.new_tokens, True, False, graphs=g)) + 2
                    for _ in range(args.repeats))
        print("  stages, async generate (us/step): " + ", ".join(
            f"{name} {STAGE_S[name] / steps * 1e6:.0f}" for _, name in STAGES), flush=True)
    if args.profile:
        prof = cProfile.Profile()
        for _ in range(args.profile):
            run(model, timer, args.batch, args.new_tokens, True, False, prof, graphs=g)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
