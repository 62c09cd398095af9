"""Tensor parallelism on GPUs at real shapes: decode tokens/s per GPU count, host time per step.

    python -m layer5_parallel.bench.tp_gpu_bench [--shapes llama-3.2-1b,llama-3.1-8b] [--out DIR]
    (also part of `stack bench --layer 5` on a machine with 2+ GPUs)

For each shape (random bf16 weights of Llama-3.2-1B's and Llama-3.1-8B's exact shapes: the
speed does not depend on the values), each TP size the GPUs allow (1, 2, 4) and each
workload (batch 1 x 128 new tokens: latency; batch 32 x 64: throughput), all with CUDA
graphs on every rank:

- decode tokens/s: (B * (N - 1)) / (time of an N-token run - time of a 1-token run), the
  prefill cancelled out; each time from CUDA events around generate() after a warm-up,
  the better of `repeats` runs;
- the measured decode step beside the planner's predicted one (planner.cost on the H100's
  datasheet ceilings and NVLink's alpha-beta);
- rank 0's host time per decode step: the engine's step() time minus the time it waited for
  the GPU (the step's event) and for the workers to take the next step (a full shared-memory
  ring), i.e. what the CPU spends launching a step (target at TP=N: <= 1.3x TP=1's); like the
  tokens/s, the N-token run's minus the 1-token run's (the prefill cancelled out); beside it
  the thread's CPU time outside the waits (time.thread_time: wall well above it is blocking
  that the waits above do not catch);
- rank 0's decode step by phase (one more run per batch; step_phases.py): schedule, input
  prep, ring put, graph launch, sampling launch, waits, reading the previous step's tokens,
  postprocess, outputs, each in wall and CPU microseconds per step;
- whether TP=N's greedy tokens equal TP=1's (bf16: the all-reduce sums in another order,
  so a near-tie may flip late in a sequence: the first differing position is reported).

Writes tp_gpu.json and tp_gpu.png (tokens/s against GPUs, with the ideal line N x TP=1).

A run cut short still says where it was: a progress line (elapsed seconds, flushed) ends every
phase (weights drawn, workers spawned, shards built, caches made, graphs captured, warm-up,
each measurement, whose row is printed at once), and no phase may last longer than
--phase-timeout seconds: past it every thread's stack is printed and the process exits (its
workers die with it). Every rank draws the random weights itself on its own GPU from one seed
(runtime/random_source.py): no weights cross between processes at start-up.
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

import layer4_algorithms as engine

from .. import planner
from ..llm import LLM
from ..runtime import group as runtime_group
from ..runtime.random_source import random_net
from ..tensor_parallel.shard import FUSED_NORMS_ENV
from .step_phases import (
    cpu_probe,
    engine_wait,
    format_probe,
    format_summary,
    phase_run,
    pin_processes,
)

l3 = engine.executor
SHAPES = {"llama-3.2-1b": l3.LLAMA_3_2_1B, "llama-3.1-8b": planner.LLAMA_3_8B}
_PEER = engine.comm.PeerAllReduce
#: The decode options a TP layout may set (--switches): name -> (the environment variable the
#: workers read when they start, the attribute of rank 0's PeerAllReduce class or None)
#: send: batch 1's row-parallel GEMVs send their outputs from their epilogue (layer 2's
#: gemv_send.py)
SWITCHES = {"pdl": (_PEER.PDL_ENV, "pdl"), "ll": (_PEER.LL_ENV, "low_latency"),
            "norms": (FUSED_NORMS_ENV, None), "send": (_PEER.GEMV_SEND_ENV, "gemv_send")}
WORKLOADS = ((1, 128), (32, 64))  # (batch, new tokens)
PROMPT_LEN = 128


def _cpu_timed(fn, add):
    """fn, adding each call's thread CPU seconds to add() (also when it raises)."""
    def timed(*a, **k):
        c = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            add(time.thread_time() - c)
    return timed


class HostClock:
    """Rank 0's time waiting: for step events, and for the workers to free a slot of the
    shared-memory ring (a GPU-bound step's back-pressure), so host time = step time - waits;
    and the thread's CPU time inside step() (time.thread_time), the waits' CPU time apart.
    close() puts the engine's calls back."""

    def __init__(self, llm) -> None:
        self.llm, self._waited, self._waited_cpu, self.cpu_s = llm, 0.0, 0.0, 0.0
        inner, step, wait = llm._complete, llm.step, engine_wait(llm)
        group = getattr(llm, "tp_group", None)
        self.ring = getattr(group, "ring", None)

        def timed(launched, advanced, finished) -> None:
            if launched.event is not None and launched.sampled is None:
                t, c = time.perf_counter(), time.thread_time()
                wait(launched.event)  # the engine's own wait (then the engine's returns at once)
                self._waited += time.perf_counter() - t
                self._waited_cpu += time.thread_time() - c
            inner(launched, advanced, finished)

        llm._complete, llm.step = timed, _cpu_timed(step, self._add_cpu)
        if self.ring is not None:  # the ring's waits: their CPU time, beside their waited_s
            self.ring._wait = _cpu_timed(self.ring._wait, self._add_wait_cpu)  # noqa: SLF001

    def _add_cpu(self, s: float) -> None:
        self.cpu_s += s

    def _add_wait_cpu(self, s: float) -> None:
        self._waited_cpu += s

    @property
    def wait_s(self) -> float:
        return self._waited + (self.ring.waited_s if self.ring is not None else 0.0)

    @property
    def host_cpu_s(self) -> float:
        """CPU seconds inside step() outside the waits."""
        return self.cpu_s - self._waited_cpu

    def close(self) -> None:
        del self.llm._complete, self.llm.step  # the instance's wrappers: the class's methods back
        if self.ring is not None and self.ring.seq is not None:
            del self.ring._wait  # noqa: SLF001


class Progress:
    """Flushed progress lines with the elapsed seconds; each one re-arms the phase bound."""

    def __init__(self, phase_timeout_s: float | None = None) -> None:
        self.start, self.phase_timeout_s = time.monotonic(), phase_timeout_s

    def __call__(self, what: str) -> None:
        print(f"[tp-gpu-bench +{time.monotonic() - self.start:7.1f} s] {what}", flush=True)
        if self.phase_timeout_s:  # the next phase must end within the bound, or stacks + exit
            faulthandler.dump_traceback_later(self.phase_timeout_s, exit=True, file=sys.stdout)

    def done(self) -> None:
        faulthandler.cancel_dump_traceback_later()


def _quiet(what: str) -> None:
    pass


def parse_switches(text: str) -> frozenset | None:
    """"default" -> None (the engine's own defaults); "off" -> every switch off; "pdl+ll+norms"
    -> those on, the rest off. ValueError naming the known switches otherwise."""
    if text == "default":
        return None
    names = frozenset() if text == "off" else frozenset(text.split("+"))
    unknown = sorted(names - set(SWITCHES))
    if unknown or not text:
        raise ValueError(f"switches {text!r}: 'default', 'off' or names joined by '+' from "
                         f"{', '.join(SWITCHES)}")
    return names


class switched:
    """Context: the decode switches `on` (a parse_switches set; None: leave everything as is)
    for the engine started inside: environment for its workers, class attributes for rank 0;
    both put back on exit."""

    def __init__(self, on: frozenset | None) -> None:
        self.on, self.saved_env, self.saved_attr = on, {}, {}

    def __enter__(self) -> switched:
        for name, (env, attr) in SWITCHES.items() if self.on is not None else ():
            self.saved_env[env] = os.environ.get(env)
            os.environ[env] = "1" if name in self.on else "0"
            if attr is not None:
                self.saved_attr[attr] = _PEER.__dict__.get(attr)
                setattr(_PEER, attr, name in self.on)
        return self

    def __exit__(self, *exc) -> None:
        for env, value in self.saved_env.items():
            if value is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = value
        for attr, value in self.saved_attr.items():
            setattr(_PEER, attr, value)


def random_weights(config, *, backend: str, device: str, seed: int = 0,
                   std: float = 0.02, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Layer 3's network of `config`'s shape with N(0, std) bf16 weights drawn on the GPU
    (layer 3's random_model draws them on the CPU in fp32: minutes for the 8B shape); every
    worker rank draws the same ones on its own GPU."""
    return random_net(config, backend=backend, dtype=dtype, device=device, seed=seed, std=std)


def _generate(llm, prompts, n: int) -> tuple[float, list[list[int]]]:
    """(seconds, tokens) of one greedy run: CUDA events around it on a GPU (the wall clock on a
    CPU, where the tests run this bench's measurements on gloo)."""
    params = l3.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    if not torch.cuda.is_available():
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    outs = llm.generate(prompts, params)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3, [o.outputs[0].token_ids for o in outs]


#: 1-token runs per measurement, the fastest kept: one slow 1-token run (a compile, a hiccup)
#: subtracted from the N-token run once gave a negative or absurd decode time
ONE_TOKEN_RUNS = 3


def measure(llm, prompts, n: int, repeats: int) -> dict:
    """Decode tokens/s, step ms and rank 0's host ms per decode step for one workload. Host
    time per decode step, like the tokens/s, is the N-token run's minus the 1-token run's
    (the prefill cancelled out; the fastest of ONE_TOKEN_RUNS), over the steps between them:
    wall time minus waits (host_ms_per_step) and the thread's CPU time outside the waits
    (host_cpu_ms_per_step); host_ms_per_step_all is the N-token run's wall minus waits over all
    its steps, prefill included (this bench's figure before the decode-only one)."""
    clock = HostClock(llm)
    best = None
    try:
        for _ in range(repeats):
            one = None
            for _ in range(ONE_TOKEN_RUNS):
                w0, c0 = clock.wait_s, clock.host_cpu_s
                t1, _ = _generate(llm, prompts, 1)
                run = (t1, llm.stats.steps,  # generate() reset the stats
                       llm.stats.elapsed_s - (clock.wait_s - w0), clock.host_cpu_s - c0)
                if one is None or run[0] < one[0]:
                    one = run
            t1, steps1, host1, cpu1 = one
            w1, c1 = clock.wait_s, clock.host_cpu_s
            tn, tokens = _generate(llm, prompts, n)
            steps, elapsed = llm.stats.steps, llm.stats.elapsed_s
            hostn = elapsed - (clock.wait_s - w1)
            cpun = clock.host_cpu_s - c1
            decode_steps = max(steps - steps1, 1)
            decode_s = tn - t1 if tn > t1 else float("nan")  # nan: noise larger than the decode
            row = {"decode_tok_s": len(prompts) * (n - 1) / decode_s,
                   "step_ms": 1e3 * decode_s / (n - 1), "steps": steps,
                   "host_ms_per_step": 1e3 * (hostn - host1) / decode_steps,
                   "host_cpu_ms_per_step": 1e3 * (cpun - cpu1) / decode_steps,
                   "host_ms_per_step_all": 1e3 * hostn / steps,
                   "tokens": tokens}
            if best is None or not best["decode_tok_s"] >= row["decode_tok_s"]:
                best = row
    finally:
        clock.close()
    return best


def host_profile(llm, prompts, n: int, top: int = 14) -> str:
    """Where rank 0's host time goes: one run under cProfile, the functions by own time."""
    import cProfile  # noqa: PLC0415 - only with --profile-host
    import io  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    prof = cProfile.Profile()
    prof.enable()
    _generate(llm, prompts, n)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return "\n".join(line for line in text.getvalue().splitlines() if line.strip())


def gpu_profile(llm, prompts, n: int, top: int = 24, sequence: int = 32) -> str:
    """Rank 0's GPU over one run under torch.profiler: kernel time per decode step beside the
    step's wall time (busy fraction: what is left is the GPU waiting for the host or for the
    other ranks), the kernels by total time (those inside CUDA graphs included, with the mean
    time of one call), and `sequence` kernels in a row from the middle of the run (a decode
    step's layers there), each with its time and the idle gap before it: what one layer
    launches, in order, and what the gaps between its kernels cost."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415 - only when asked

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall, _ = _generate(llm, prompts, n)
    steps = max(llm.stats.steps, 1)
    kernels = [e for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.self_device_time_total for e in kernels)
    lines = [f"wall {1e3 * wall / steps:.3f} ms/step, kernels {busy_us / 1e3 / steps:.3f} ms/step "
             f"({100 * busy_us / 1e6 / wall:.0f} % busy) over {steps} steps"]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        per_call = e.self_device_time_total / max(e.count, 1)
        lines.append(f"  {e.self_device_time_total / 1e3 / steps:8.4f} ms/step "
                     f"{e.count / steps:6.1f}/step {per_call:7.2f} us/call  {e.key[:80]}")
    if sequence:
        lines.append(kernel_sequence([e for e in prof.events()
                                      if e.device_type == torch.autograd.DeviceType.CUDA],
                                     sequence))
    return "\n".join(lines)


def kernel_sequence(events, count: int) -> str:
    """`count` device events in start order from the middle of `events` (FunctionEvents with
    a time_range in us): start offset, duration, the idle gap since the previous one ended."""
    events = sorted(events, key=lambda e: e.time_range.start)
    mid = len(events) // 2
    window = events[mid:mid + count]
    if not window:
        return "  (no kernels recorded)"
    lines = [f"  {count} kernels in a row from the middle of the run "
             "(start us, duration us, gap us before it):"]
    t0, prev_end = window[0].time_range.start, events[mid - 1].time_range.end if mid else None
    for e in window:
        r = e.time_range
        gap = float("nan") if prev_end is None else r.start - prev_end
        lines.append(f"  {r.start - t0:9.1f} {r.end - r.start:7.2f} {gap:6.2f}  {e.name[:80]}")
        prev_end = r.end
    return "\n".join(lines)


def first_difference(a: list[list[int]], b: list[list[int]]) -> int | None:
    """The earliest position where any sequence's tokens differ (None: all equal)."""
    diffs = [next((k for k in range(len(x)) if x[k] != y[k]), None) for x, y in zip(a, b,
                                                                                  strict=True)]
    diffs = [d for d in diffs if d is not None]
    return min(diffs) if diffs else None


def bench_shape(name: str, layouts: list[tuple], *, repeats: int = 2,
                backend: str = "triton", workloads=WORKLOADS, log=_quiet,
                tp_timeout_s: float = 300.0, profile_host: bool = False,
                phases: bool = True, config=None, device: str = "cuda:0",
                dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """layouts: (tp, tp_backend[, worker_spin_s[, pin[, worker_pause_s[, switches]]]]), TP=1
    first (the
    reference of tokens and speed); worker_spin_s: how long the workers spin on the ring
    before they nap (runtime/group.py's SPIN_S; None: its default); pin: rank 0 and each
    worker on a physical core of its own (step_phases.pin_processes) while that layout runs;
    worker_pause_s: the workers' pause between reads while they spin (SPIN_PAUSE_S; 0:
    sched_yield, a busy loop; None: its default); switches: a parse_switches text (the decode
    options of layer 2's all-reduce and the fused norms: "pdl+ll+norms"; None: the defaults).
    log: told when each phase ends (Progress). profile_host: also print where rank 0's host
    time goes (cProfile) and its GPU's (torch.profiler) at each batch (two more runs each).
    phases: one more run per batch with rank 0's step timed by phase (step_phases.py), kept
    in the row ("phases") and printed, with a probe of rank 0's CPU (step_phases.cpu_probe).
    config, device, dtype: another shape than `name`'s, elsewhere (the tests run a tiny one
    on the CPU, tensor parallelism over gloo)."""
    config = config or l3.ModelConfig.from_dict(SHAPES[name])
    net = random_weights(config, backend=backend, device=device, dtype=dtype)
    _empty_cache(sync=True)
    model = l3.Model(net)
    log(f"{name}: random {str(dtype).removeprefix('torch.')} weights drawn on {device} "
        f"({sum(p.numel() * p.element_size() for p in net.parameters()) / 2**30:.2f} GiB)")
    g = torch.Generator().manual_seed(0)
    big = max(b for b, _ in workloads)
    prompts = [torch.randint(0, config.vocab_size, (PROMPT_LEN,), generator=g).tolist()
               for _ in range(big)]
    longest = PROMPT_LEN + max(n for _, n in workloads) + 16
    blocks = big * -(-longest // 16) + 16
    rows, ref = [], {}
    for tp, tp_backend, *more in layouts:
        spin, pin, pause, switches = list(more) + [None, False, None, None][len(more):]
        label = (tp_backend if spin is None else f"{tp_backend}@{spin:g}s") + ("+pin" if pin
                                                                                else "")
        label += "" if pause is None else f"/{pause * 1e6:g}us"
        label += "" if switches is None else f"[{switches}]"
        what = f"{name} TP={tp} {label}"
        saved_spin, saved_pause = dict(runtime_group.SPIN_S), runtime_group.SPIN_PAUSE_S
        if spin is not None:  # the group reads it at start: this engine's workers only
            runtime_group.SPIN_S["nccl"] = runtime_group.SPIN_S["gloo"] = spin
        if pause is not None:
            runtime_group.SPIN_PAUSE_S = pause
        log(f"{what}: starting the engine (CUDA graphs on every rank)")
        # the switches hold for the engine's whole life: the workers read them as they start,
        # rank 0 at every call (every rank must take the same kernels, eager calls too)
        options = switched(parse_switches(switches) if switches is not None else None)
        options.__enter__()
        try:
            llm = LLM(model, tensor_parallel_size=tp, cuda_graph=True, num_blocks=blocks,
                      max_num_seqs=big, max_model_len=longest, tp_backend=tp_backend,
                      tp_timeout_s=tp_timeout_s, async_scheduling=True)
        except BaseException:
            options.__exit__()
            raise
        finally:
            runtime_group.SPIN_S.update(saved_spin)
            runtime_group.SPIN_PAUSE_S = saved_pause
        spin_s = runtime_group.SPIN_S["nccl"] if spin is None else spin
        pause_s = runtime_group.SPIN_PAUSE_S if pause is None else pause
        affinity, pinned = os.sched_getaffinity(0), None
        try:
            if pin:
                pinned = pin_processes(llm)
                log(f"{what}: rank 0 and the workers pinned to cpus {pinned} (None: too few "
                    "cores, not pinned)")
            log(f"{what}: engine up")
            _generate(llm, prompts[:2], 4)  # warm-up
            log(f"{what}: warm-up done")
            for batch, n in workloads:
                r = measure(llm, prompts[:batch], n, repeats)
                tokens = r.pop("tokens")
                if tp == 1 and batch not in ref:
                    ref[batch] = tokens
                hw = planner.hardware_for(_datasheet(), tp_backend=tp_backend)
                pred = planner.cost(config, hw, tp, 1, 1, batch=batch,
                                    context=PROMPT_LEN + n // 2, nbytes=2)
                diff = first_difference(ref[batch], tokens)
                rows.append({"shape": name, "tp": tp, "batch": batch, "new_tokens": n,
                             "tp_backend": tp_backend, "layout": label,
                             "worker_spin_s": spin_s if tp > 1 else None,
                             "worker_pause_s": pause_s if tp > 1 else None, "pinned_cpus": pinned,
                             **r,
                             "predicted_step_ms": 1e3 * pred.step_s,
                             "predicted_comm_ms": 1e3 * pred.tp_comm_s,
                             "same_tokens": diff is None, "first_difference": diff})
                log(f"{what}: batch {batch} x {n} tokens: {r['decode_tok_s']:,.0f} tok/s, "
                    f"step {r['step_ms']:.3f} ms, host {r['host_ms_per_step']:.3f} ms/step "
                    f"(cpu {r['host_cpu_ms_per_step']:.3f}; with the prefill "
                    f"{r['host_ms_per_step_all']:.3f}), "
                    f"same tokens as TP=1: {'yes' if diff is None else f'until {diff}'}")
                if phases:  # one more run, every call of rank 0's step timed
                    _phases(llm, rows[-1], prompts[:batch], n, spin_s, what, log)
            for batch, n in workloads if profile_host else ():
                log(f"{what}: rank 0's host, batch {batch}, by own time:\n"
                    + host_profile(llm, prompts[:batch], n))
                log(f"{what}: rank 0's GPU, batch {batch}:\n"
                    + gpu_profile(llm, prompts[:batch], n))
        finally:
            os.sched_setaffinity(0, affinity)
            llm.close()
            options.__exit__()
            llm = None
            gc.collect()  # the engine's graphs and cache, before the next layout allocates
            _empty_cache()
            log(f"{what}: closed")
    del model, net
    gc.collect()
    _empty_cache()
    base = {(r["shape"], r["batch"]): r for r in rows if r["tp"] == 1}
    for r in rows:
        b = base.get((r["shape"], r["batch"]))
        if b is not None:
            r["speedup"] = r["decode_tok_s"] / b["decode_tok_s"]
            r["host_vs_tp1"] = r["host_ms_per_step"] / b["host_ms_per_step"]
            r["host_cpu_vs_tp1"] = r["host_cpu_ms_per_step"] / b["host_cpu_ms_per_step"]
    return rows


def _phases(llm, row: dict, prompts, n: int, spin_s: float, what: str, log) -> None:
    """Rank 0's decode step by phase and the CPU probe into `row`, printed. A diagnostic: if
    it fails, the error is printed and kept in the row, and the bench goes on (an engine that
    failed mid-step fails the next measurement itself)."""
    try:
        row["phases"] = phase_run(llm, lambda: _generate(llm, prompts, n))
        row["cpu_probe"] = cpu_probe(llm, spin_s)
        log(f"{what}: batch {len(prompts)}: rank 0's decode step by phase:\n"
            + format_summary(row["phases"]) + "\n" + format_probe(row["cpu_probe"]))
    except Exception as exc:  # noqa: BLE001 - reported, the measurements go on
        row["phases_error"] = f"{type(exc).__name__}: {exc}"
        log(f"{what}: batch {len(prompts)}: the phase breakdown failed: {row['phases_error']}")
        for rid in list(getattr(llm, "_requests", {})):  # nothing of that run left queued
            llm.abort(rid)
        llm.drain()


def plot(rows: list[dict], path: Path) -> None:
    """Decode tokens/s against GPUs: a panel per shape x batch, a line per TP backend (all from
    the same TP=1 point), and the ideal line."""
    import matplotlib  # noqa: PLC0415 - only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    keys = sorted({(r["shape"], r["batch"]) for r in rows})
    lines = len({_label(r) for r in rows if r["tp"] > 1}) + 1  # + the ideal line
    ncol = 2 if len(keys) > 1 else 1
    legend_in = 0.25 * -(-lines // ncol) + 0.2  # the legend's rows, under the panels
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6 + legend_in),
                             squeeze=False)
    for ax, (shape, batch) in zip(axes[0], keys, strict=True):
        mine = [r for r in rows if r["shape"] == shape and r["batch"] == batch]
        base = next(r["decode_tok_s"] for r in mine if r["tp"] == 1)
        for backend in sorted({_label(r) for r in mine if r["tp"] > 1}):
            pts = [(1, base)] + sorted((r["tp"], r["decode_tok_s"]) for r in mine
                                       if r["tp"] > 1 and _label(r) == backend)
            name = {"torch": "NCCL", "ours": "layer 2's all-reduce"}.get(backend, backend)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"measured, {name}")
        x = sorted({r["tp"] for r in mine})
        ax.plot(x, [base * t for t in x], "--", color="gray", label="ideal (N x TP=1)")
        ax.set_title(f"{shape}, batch {batch}")
        ax.set_xlabel("GPUs (tensor parallel)")
        ax.set_xticks(x)
        ax.set_ylabel("decode tokens/s")
        ax.set_ylim(bottom=0)
        failed = sorted({r["tp"] for r in mine if not r["decode_tok_s"] >= 0})  # nan: no figure
        if failed:
            ax.text(0.03, 0.97, "not measured: TP=" + ", ".join(map(str, failed)),
                    transform=ax.transAxes, va="top", color="firebrick")
    # one legend under the panels (their lines share labels): inside, long switch names
    # covered the points and the axis
    seen = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    fig.legend(list(seen.values()), list(seen), loc="lower center", ncol=ncol, frameon=False)
    fig.tight_layout(rect=(0, legend_in / (3.6 + legend_in), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _empty_cache(sync: bool = False) -> None:
    if torch.cuda.is_available():
        if sync:
            torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _label(row: dict) -> str:
    return row.get("layout", row["tp_backend"])


def _datasheet() -> str:
    """The planner's name for this GPU (its datasheet predicts the step), H100 if unknown."""
    if not torch.cuda.is_available():
        return "h100"
    return "h200" if "H200" in torch.cuda.get_device_name(0) else "h100"


def bench_tp_gpu(shapes: list[str], out_dir: Path, *, repeats: int = 2,
                 tp_backends: tuple[str, ...] = ("torch",), log=_quiet,
                 profile_host: bool = False, tps: list[int] | None = None,
                 phases: bool = True, worker_spins: list[float] | None = None,
                 pin_cpus: bool = False, worker_pauses: list[float] | None = None,
                 switch_sets: list[str] | None = None) -> dict:
    """tps: the TP sizes beyond 1 to run (default every power of two up to the GPUs);
    worker_spins: run each TP layout once per value (the workers' spin on the ring before
    they nap; default: the group's own, once); pin_cpus: each TP layout once more (at the
    first spin) with rank 0 and every worker pinned to a physical core of its own;
    worker_pauses: each TP layout once per value of the workers' pause between reads while
    they spin (0: a busy loop; default: the group's own, once); switch_sets: each TP layout
    once per set of decode switches (parse_switches texts; default: the engine's, once), all
    beside the same TP=1 run."""
    gpus = torch.cuda.device_count()
    tps = [t for t in (tps or (2, 4, 8)) if 1 < t <= gpus]
    rows: list[dict] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(0), "gpus": gpus, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    spins = worker_spins or [None]
    pauses = worker_pauses or [None]
    sets = switch_sets or [None]
    layouts = [(1, "torch")] + [(t, b, w, False, p, sw) for b in tp_backends for w in spins
                                for p in pauses for sw in sets for t in tps]
    if pin_cpus:
        layouts += [(t, b, spins[0], True) for b in tp_backends for t in tps]
    for name in shapes:
        new = bench_shape(name, layouts, repeats=repeats, log=log, profile_host=profile_host,
                          phases=phases)
        rows += new
        (out_dir / "tp_gpu.json").write_text(json.dumps(result, indent=2))  # as it goes
        print(format_rows(new), flush=True)
    plot(rows, out_dir / "tp_gpu.png")
    return result


def format_rows(rows: list[dict]) -> str:
    head = (f"{'shape':14} {'tp':>2} {'B':>3} {'backend':14} {'tok/s':>9} {'x TP1':>6} "
            f"{'step ms':>8} {'pred ms':>8} {'host ms':>8} {'host x':>7} {'cpu ms':>7} "
            f"{'cpu x':>6} same")
    lines = [head]
    for r in rows:
        lines.append(f"{r['shape']:14} {r['tp']:>2} {r['batch']:>3} {_label(r):14} "
                     f"{r['decode_tok_s']:>9,.0f} {r.get('speedup', float('nan')):>6.2f} "
                     f"{r['step_ms']:>8.3f} {r['predicted_step_ms']:>8.3f} "
                     f"{r['host_ms_per_step']:>8.3f} {r.get('host_vs_tp1', float('nan')):>7.2f} "
                     f"{r.get('host_cpu_ms_per_step', float('nan')):>7.3f} "
                     f"{r.get('host_cpu_vs_tp1', float('nan')):>6.2f} "
                     f"{'yes' if r['same_tokens'] else r['first_difference']}")
    return "\n".join(lines)


def _seconds_list(ap: argparse.ArgumentParser, flag: str, text: str | None) -> list[float] | None:
    """A flag's comma-separated seconds (each >= 0), None when not given; else a usage error."""
    if not text:
        return None
    try:
        values = [float(w) for w in text.split(",")]
    except ValueError:
        values = [-1.0]
    if min(values) < 0:
        ap.error(f"{flag} {text!r}: seconds >= 0, comma-separated")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m layer5_parallel.bench.tp_gpu_bench")
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    ap.add_argument("--out", default="results/layer5")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tp-backends", default="torch")
    ap.add_argument("--phase-timeout", type=float, default=240.0,
                    help="seconds any one phase may take (0: no bound); past it: stacks, exit")
    ap.add_argument("--tps", default="2,4,8",
                    help="TP sizes beyond 1, comma-separated (those above the GPUs are skipped)")
    ap.add_argument("--worker-spin", default="",
                    help="seconds the workers spin on the ring before napping, comma-separated: "
                         "each TP layout once per value (default: the runtime's, once)")
    ap.add_argument("--worker-pause", default="",
                    help="seconds the workers pause between reads of the ring while they spin "
                         "(0: sched_yield, a busy loop), comma-separated: each TP layout once "
                         "per value (default: the runtime's, once)")
    ap.add_argument("--pin-cpus", action="store_true",
                    help="each TP layout once more with rank 0 and every worker pinned to a "
                         "physical core of its own")
    ap.add_argument("--switches", default="",
                    help="each TP layout once per set of decode switches, comma-separated: "
                         "'default', 'off', or names joined by '+' from "
                         + ", ".join(SWITCHES) + " (those on, the rest off)")
    ap.add_argument("--no-phases", action="store_true",
                    help="skip the run per batch that times rank 0's step by phase")
    ap.add_argument("--profile-host", action="store_true",
                    help="also print where rank 0's host and GPU time go at each batch")
    args = ap.parse_args(argv)
    tps = [t.strip() for t in args.tps.split(",")]
    if not all(t.isdigit() and int(t) > 1 for t in tps):
        ap.error(f"--tps {args.tps!r}: TP sizes above 1, comma-separated (e.g. 2,4)")
    switch_sets = [w.strip() for w in args.switches.split(",")] if args.switches else None
    for text in switch_sets or ():
        try:
            parse_switches(text)
        except ValueError as exc:
            ap.error(str(exc))
    spins = _seconds_list(ap, "--worker-spin", args.worker_spin)
    pauses = _seconds_list(ap, "--worker-pause", args.worker_pause)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}: choose from {', '.join(SHAPES)}")
    if not torch.cuda.is_available():
        ap.error("needs CUDA GPUs (on a CPU: `stack bench --layer 5` runs the course model)")
    log = Progress(args.phase_timeout or None)
    log(f"{torch.cuda.device_count()} GPU(s), torch {torch.__version__}; shapes {args.shapes}, "
        f"TP backends {args.tp_backends}")
    runtime_group.progress = log  # the engine's start-up phases too
    try:
        r = bench_tp_gpu(args.shapes.split(","), Path(args.out), repeats=args.repeats,
                         tp_backends=tuple(args.tp_backends.split(",")), log=log,
                         profile_host=args.profile_host,
                         tps=[int(t) for t in tps], phases=not args.no_phases,
                         worker_spins=spins, pin_cpus=args.pin_cpus, worker_pauses=pauses,
                         switch_sets=switch_sets)
    finally:
        runtime_group.progress = None
        log.done()
    print(f"{r['device']} x {r['gpus']}, torch {r['torch']}")
    print(format_rows(r["rows"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
