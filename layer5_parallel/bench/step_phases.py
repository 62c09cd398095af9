"""Where rank 0's decode step goes: `step()` cut into phases, wall and CPU time per phase.

    python -m layer5_parallel.bench.step_phases [--tps 1,2] [--batches 1,8] [--new-tokens 48]
    (on a CPU: a tiny random model, tensor parallelism over gloo; tp_gpu_bench uses the same
    clock on GPUs)

`PhaseClock(llm)` wraps, on the engine instance only (nothing changes for other engines), the
calls one step makes, and charges every moment of a `step()` to the innermost phase running
(exclusive time: the phases of a step add up to its whole time):

    schedule         the scheduler's schedule()
    input ids        the step's token ids on the device (decode: a gather of the previous
                     step's samples there)
    context          block tables, positions, slots to the device (a graph-replayed decode:
                     the check that the tables hold the positions; else the cache's whole
                     context and the table mirror)
    execute          the rest of the runner's execute() (a decode step's one pass over its
                     sequences, staging, copy-on-write, logits rows)
    graph inputs     the step's inputs into the CUDA graph's static buffers (a decode step:
                     the ids, then positions, lengths and tables in one copy from the host)
    ring put         telling the workers which graph to replay (the control message: a
                     liveness check, the pickle, the shared-memory ring)
    graph launch     the graph's replay() (on a CPU, where nothing is captured: the step's
                     eager forward, broadcast and collectives included)
    forward (eager)  a forward pass outside the graphs (prefill, mixed steps)
    sampling launch  the argmax / sampler kernels and the tokens' copy back (pinned buffer,
                     event); `sample (host)` when the step samples synchronously
    wait GPU         waiting for the previous step's tokens (its event; the engine's own wait)
    wait ring        waiting for a free slot of the ring (the workers are behind)
    read tokens      the previous step's tokens to Python lists
    postprocess      the scheduler appending them (stop checks, freeing)
    outputs          building the step's RequestOutputs
    other            step()'s own code and anything not named above

Each phase has its wall time and this thread's CPU time (time.thread_time). A phase whose
wall time is well above its CPU time blocked in the kernel (a sleep, a lock, a blocking
driver call): on a GPU host that names host "work" that is really waiting. Only decode steps
(every scheduled sequence one new token) are averaged; the clock's own cost (a few clock reads
per phase change, measured at start) is reported beside them and included in the phases.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from ..runtime.rank0 import wait_event

WAITS = ("wait GPU", "wait ring")
ORDER = ("schedule", "input ids", "context", "execute", "graph inputs", "ring put",
         "graph launch", "forward (eager)", "sampling launch", "sample (host)", "wait GPU",
         "wait ring", "read tokens", "postprocess", "outputs", "other")


def engine_wait(llm):
    """The wait the engine itself does for a launched step's event: layer 5's bounded one
    (wait_event: spins, then polls, checking the workers) over several ranks, else
    event.synchronize(). The clocks time this wait, so what they time is what the engine does."""
    group = getattr(llm, "tp_group", None)
    if group is None:
        return lambda event: event.synchronize()
    return lambda event: wait_event(group, event, "reading a step's tokens")


class _TimedGraph:
    """A captured graph whose replay() is a phase."""

    def __init__(self, graph, clock: PhaseClock) -> None:
        self.graph, self.clock = graph, clock

    def replay(self) -> None:
        self.clock.enter("graph launch")
        try:
            self.graph.replay()
        finally:
            self.clock.exit()

    def __getattr__(self, name):
        return getattr(self.graph, name)


class PhaseClock:
    """Rank 0's step() of `llm` (layer 4's or layer 5's engine) timed by phase; `close()` puts
    every wrapped call back. `summary()`: per-phase means over the decode steps seen."""

    def __init__(self, llm) -> None:
        self.llm, self.stack, self._undo = llm, [], []
        self._t = self._c = 0.0
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.changes = 0  # phase changes in the current step (for the clock's own cost)
        self.decode = False  # the current step scheduled decodes only
        self.steps: list[tuple[dict, dict, int]] = []  # decode steps: (wall, cpu, changes)
        self.other_steps = 0
        self.change_cost_s = _change_cost()
        runner, group = llm.runner, getattr(llm, "tp_group", None)
        self._wrap(llm, "step", "other", root=True)
        self._wrap(llm.scheduler, "schedule", "schedule", after=self._saw_schedule)
        self._wrap(llm.scheduler, "postprocess", "postprocess")
        self._wrap(runner, "execute", "execute")
        self._wrap(runner, "input_ids", "input ids")
        self._wrap(runner, "place_ids", "input ids")
        self._wrap(llm.cache, "context", "context")
        self._wrap(runner.tables, "gather", "context")
        self._wrap(runner, "_graph_run", "context")
        self._wrap(runner.net, "forward", "forward (eager)")
        self._wrap(runner, "sample_tokens", "sampling launch")
        self._wrap(runner, "sample", "sample (host)")
        self._wrap(llm, "_sample_on_device", "sampling launch")
        self._wrap(llm, "_outputs", "outputs")
        self._wrap_complete()
        graph = getattr(runner, "graph", None)
        if graph is not None:
            self._wrap(graph, "run", "graph inputs")
            self._wrap(graph, "run_host", "graph inputs")
            if graph.graphs:
                self._graphs = dict(graph.graphs)
                graph.graphs.update({b: _TimedGraph(g, self) for b, g in self._graphs.items()})
            else:  # nothing captured (a CPU): the step runs eagerly
                self._wrap(graph, "_step", "graph launch")
        if group is not None:
            self._wrap(group, "send", "ring put")
            if group.ring is not None:
                self._wrap(group.ring, "_wait", "wait ring")

    # ---- the clock ----------------------------------------------------------------------------
    def _charge(self) -> None:
        t, c = time.perf_counter(), time.thread_time()
        if self.stack:
            top = self.stack[-1]
            self.wall[top] += t - self._t
            self.cpu[top] += c - self._c
        self._t, self._c = t, c

    def enter(self, phase: str) -> None:
        self._charge()
        self.stack.append(phase)
        self.changes += 1

    def exit(self) -> None:
        self._charge()
        self.stack.pop()

    # ---- wrapping ------------------------------------------------------------------------------
    def _wrap(self, obj, attr: str, phase: str, *, root: bool = False, after=None) -> None:
        if not hasattr(obj, attr):  # an engine without this call: nothing to time
            return
        own = attr in vars(obj)
        inner = getattr(obj, attr)
        self._undo.append((obj, attr, own, vars(obj).get(attr)))
        clock = self

        def timed(*a, **k):
            if root:
                clock._start_step()
            clock.enter(phase)
            try:
                out = inner(*a, **k)
                if after is not None:
                    after(out)
                return out
            finally:
                clock.exit()
                if root:
                    clock._end_step()

        setattr(obj, attr, timed)

    def _wrap_complete(self) -> None:
        """Reading a launched step: its wait (the event), the tokens to lists, then the rest."""
        llm = self.llm
        own = "_complete" in vars(llm)
        inner, wait = llm._complete, engine_wait(llm)
        self._undo.append((llm, "_complete", own, vars(llm).get("_complete")))

        def timed(launched, advanced, finished) -> None:
            if launched.sampled is None:
                if launched.event is not None:
                    self.enter("wait GPU")
                    try:
                        wait(launched.event)
                    finally:
                        self.exit()
                self.enter("read tokens")
                launched.read()  # read once: the engine's own read() returns these
                self.exit()
            self.enter("postprocess")
            try:
                inner(launched, advanced, finished)
            finally:
                self.exit()

        llm._complete = timed

    def _saw_schedule(self, out) -> None:
        self.decode = bool(out.scheduled) and all(
            s.num_new_tokens == 1 and not s.spec_token_ids for s in out.scheduled)

    def _start_step(self) -> None:
        self.wall, self.cpu = defaultdict(float), defaultdict(float)
        self.changes, self.decode = 0, False

    def _end_step(self) -> None:
        if self.decode:
            self.steps.append((self.wall, self.cpu, self.changes))
        else:
            self.other_steps += 1

    def close(self) -> None:
        """Every wrapped call back as it was (the graphs too)."""
        for obj, attr, own, old in reversed(self._undo):
            if own:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)
        self._undo = []
        graphs, self._graphs = getattr(self, "_graphs", None), None
        runner_graph = getattr(self.llm.runner, "graph", None)
        if graphs is not None and runner_graph is not None and runner_graph.graphs:
            runner_graph.graphs.update(graphs)

    def reset(self) -> None:
        self.steps, self.other_steps = [], 0

    # ---- results -------------------------------------------------------------------------------
    def summary(self) -> dict:
        """Means over the decode steps, in microseconds: {"phases": {name: [wall, cpu]},
        "step_us", "wait_us", "host_us" (step - waits), "cpu_us", "host_cpu_us" (cpu - the
        cpu spent waiting), "clock_us" (the clock's own cost, inside the above), "steps"}."""
        n = len(self.steps)
        if not n:
            return {"steps": 0, "phases": {}}
        names = {p for w, _, _ in self.steps for p in w}
        phases = {p: [1e6 * sum(w.get(p, 0.0) for w, _, _ in self.steps) / n,
                      1e6 * sum(c.get(p, 0.0) for _, c, _ in self.steps) / n]
                  for p in sorted(names, key=lambda p: ORDER.index(p) if p in ORDER else 99)}
        step = sum(v[0] for v in phases.values())
        cpu = sum(v[1] for v in phases.values())
        wait = sum(phases.get(p, [0.0, 0.0])[0] for p in WAITS)
        wait_cpu = sum(phases.get(p, [0.0, 0.0])[1] for p in WAITS)
        changes = sum(k for _, _, k in self.steps) / n
        return {"steps": n, "other_steps": self.other_steps, "phases": phases, "step_us": step,
                "wait_us": wait, "host_us": step - wait, "cpu_us": cpu,
                "host_cpu_us": cpu - wait_cpu, "clock_us": 2 * changes * 1e6 * self.change_cost_s}


def _change_cost(n: int = 2000) -> float:
    """Seconds one enter/exit pair's clock reads cost (half of the pair: one change)."""
    t = time.perf_counter()
    for _ in range(n):
        time.perf_counter()
        time.thread_time()
    return (time.perf_counter() - t) / n


def format_summary(s: dict) -> str:
    """The phases as lines: wall and CPU us per decode step, then the totals."""
    if not s.get("steps"):
        return "  (no decode steps seen)"
    lines = [f"  {'phase':16} {'wall us':>9} {'cpu us':>9}   (mean over {s['steps']} decode steps)"]
    for p, (w, c) in s["phases"].items():
        flag = "  <- blocked (wall >> cpu)" if p not in WAITS and w > 20 and c < 0.6 * w else ""
        lines.append(f"  {p:16} {w:9.1f} {c:9.1f}{flag}")
    lines.append(f"  {'step':16} {s['step_us']:9.1f} {s['cpu_us']:9.1f}")
    lines.append(f"  host = step - waits: {s['host_us']:.1f} us wall, {s['host_cpu_us']:.1f} us "
                 f"cpu (the clock itself ~{s['clock_us']:.1f} us of it)")
    return "\n".join(lines)


def phase_run(llm, run) -> dict:
    """run() (a generate call) with the clock on; its decode steps' summary."""
    clock = PhaseClock(llm)
    try:
        run()
    finally:
        clock.close()
    return clock.summary()


# ---- is rank 0's CPU slowed by the workers? -----------------------------------------------------
def _python_work() -> int:
    d, out = {}, []
    for i in range(3000):
        d[i & 63] = i
        out.append(d.get(i & 31, 0) + i)
    return len(out)


def python_probe(reps: int = 9) -> float:
    """Microseconds of a fixed pure-Python workload on this thread (the median of reps)."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        _python_work()
        times.append(time.perf_counter() - t)
    return 1e6 * sorted(times)[reps // 2]


def _cpu_of(pid: str | int) -> int | None:
    """The CPU a process last ran on (/proc/PID/stat, field 39)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def _cpus(mask) -> str:
    """A CPU set as ranges: 0-15,64-79."""
    out, run = [], []
    for c in sorted(mask):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def cpu_probe(llm, spin_s: float = 0.05) -> dict:
    """Right after a run, while the workers still spin on the ring (they spin spin_s after
    their last message): a fixed Python workload on rank 0, where each process runs and may
    run; then the same workload once the workers nap. At one rank both runs are alone: a
    slower first figure at TP=N means the workers slow rank 0's CPU down (a shared core, a
    shared physical core, a lower clock)."""
    import os  # noqa: PLC0415

    group = getattr(llm, "tp_group", None)
    pids = [p.pid for p in group.procs] if group is not None else []
    busy = python_probe()
    me = _cpu_of("self")
    workers = [_cpu_of(pid) for pid in pids]
    window = min(0.02, spin_s / 2)  # each worker's CPU use while it spins (within spin_s)
    before, t0 = [_cpu_ns(pid) for pid in pids], time.perf_counter()
    time.sleep(window)
    after, t1 = [_cpu_ns(pid) for pid in pids], time.perf_counter()
    spin_cpu = [None if a is None or b is None else round((b - a) / 1e9 / (t1 - t0), 3)
                for a, b in zip(before, after, strict=True)]
    time.sleep(spin_s + 0.1)
    idle = python_probe()
    siblings = None
    if me is not None:
        try:
            with open(f"/sys/devices/system/cpu/cpu{me}/topology/thread_siblings_list") as f:
                siblings = f.read().strip()
        except OSError:
            pass
    try:
        masks = [_cpus(os.sched_getaffinity(0))] + [_cpus(os.sched_getaffinity(pid))
                                                     for pid in pids]
    except OSError:
        masks = []
    core = _parse_cpus(siblings) if siblings else {me}
    return {"probe_us_workers_spinning": busy, "probe_us_workers_napping": idle,
            "rank0_cpu": me, "rank0_siblings": siblings, "worker_cpus": workers,
            "workers_on_rank0_core": [r for r, c in enumerate(workers, start=1) if c in core],
            "worker_cpu_while_spinning": spin_cpu, "affinity": masks, "cpus": os.cpu_count()}


def _cpu_ns(pid: int) -> int | None:
    """Nanoseconds a process's main thread has run (/proc/PID/schedstat, first field)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _parse_cpus(text: str) -> set[int]:
    """"0-3,8" -> {0, 1, 2, 3, 8}."""
    out = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def format_probe(p: dict) -> str:
    return (f"  python probe: {p['probe_us_workers_spinning']:.0f} us right after the run "
            f"(workers spinning), {p['probe_us_workers_napping']:.0f} us later (napping); "
            f"rank 0 on cpu {p['rank0_cpu']} (SMT siblings {p['rank0_siblings']}), workers on "
            f"{p['worker_cpus']} (on rank 0's core: {p['workers_on_rank0_core'] or 'none'}; "
            f"each using {p.get('worker_cpu_while_spinning')} of a cpu while spinning); "
            f"affinity {p['affinity']} of {p['cpus']} cpus")


def pin_processes(llm) -> list[int] | None:
    """Rank 0's thread and each worker's main thread each on a physical core of its own (the
    first logical CPU of distinct cores this process may run on), so no spinning worker
    shares rank 0's core (CPU 0's core only if needed). Returns the CPUs in rank order (None:
    not enough cores; nothing changed). The caller restores rank 0's affinity
    (os.sched_setaffinity(0, saved))."""
    import os  # noqa: PLC0415

    group = getattr(llm, "tp_group", None)
    pids = [0] + ([p.pid for p in group.procs] if group is not None else [])
    cores, seen = [], set()
    for c in sorted(os.sched_getaffinity(0)):
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
                core = min(_parse_cpus(f.read().strip()))
        except (OSError, ValueError):
            core = c
        if core not in seen:
            seen.add(core)
            cores.append(c)
    if len(cores) < len(pids):
        return None
    cores = cores[1:] + cores[:1]  # CPU 0's core last: it takes most of the interrupts
    for pid, c in zip(pids, cores, strict=False):
        os.sched_setaffinity(pid, {c})
    return cores[:len(pids)]


# ---- on a CPU ------------------------------------------------------------------------------------
def tiny_model(seed: int = 0):
    import layer4_algorithms as engine  # noqa: PLC0415

    l3 = engine.executor
    cfg = l3.ModelConfig(model_type="llama", vocab_size=4096, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    return l3.Model(l3.random_model(cfg, seed=seed))


def cpu_breakdown(tps: list[int], batches: list[int], new_tokens: int, *, repeats: int = 2,
                  log=print) -> list[dict]:
    """Rank 0's decode-step phases on this CPU, per TP size and batch (async scheduling and the
    decode-graph runner on, as on a GPU; the best of `repeats` runs by host CPU time)."""
    import layer4_algorithms as engine  # noqa: PLC0415

    from ..llm import LLM  # noqa: PLC0415

    model, rows = tiny_model(), []
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4096, (16,), generator=g).tolist() for _ in range(max(batches))]
    params = engine.executor.SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                            ignore_eos=True)
    for tp in tps:
        with LLM(model, tensor_parallel_size=tp, cuda_graph=True, async_scheduling=True,
                 num_blocks=max(batches) * 8 + 16, block_size=16, max_num_seqs=max(batches),
                 tp_timeout_s=60.0) as llm:
            llm.generate(prompts[:2], params)  # warm-up
            for batch in batches:
                runs = [phase_run(llm, lambda b=batch: llm.generate(prompts[:b], params))
                        for _ in range(repeats)]
                best = min(runs, key=lambda s: s.get("host_cpu_us", float("inf")))
                rows.append({"tp": tp, "batch": batch, **best})
                log(f"TP={tp} batch {batch}: host {best['host_us']:.1f} us wall, "
                    f"{best['host_cpu_us']:.1f} us cpu per decode step\n" + format_summary(best))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m layer5_parallel.bench.step_phases")
    ap.add_argument("--tps", default="1,2")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        tps = [int(t) for t in args.tps.split(",")]
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error("--tps and --batches: whole numbers, comma-separated")
    if min(tps) < 1 or min(batches) < 1 or args.new_tokens < 2 or args.repeats < 1:
        ap.error("sizes must be >= 1 (--new-tokens >= 2)")
    torch.set_num_threads(1)
    cpu_breakdown(tps, batches, args.new_tokens, repeats=args.repeats,
                  log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
