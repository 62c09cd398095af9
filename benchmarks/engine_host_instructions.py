"""Layer 4's host instructions per decode step, by phase, counted by callgrind.

    python benchmarks/engine_host_instructions.py [--seqs 256] [--steps 10] [--fine]
    python benchmarks/engine_host_instructions.py --dry      # the workload once, no valgrind
    python benchmarks/engine_host_instructions.py --prefill 2048 [--steps 6]

Instructions, unlike a clock, are the same on a busy machine: two trees are compared by
running this once with each on PYTHONPATH. The engine runs decode steps the way a GPU does
(async scheduling, generate()'s step(unfinished=False), the decode CUDA-graph runner run
eagerly: capture=False), on engine_host_time.py's tiny random model; the network's forward,
the graph bucket's step and torch's argmax (what a GPU runs) are left out of the count. Each
phase is one run of `--steps` steps after four untimed ones, with only that phase collected:
    total          LLM.step                       schedule       Scheduler.schedule
    execute        ModelRunner.execute            sample_launch  LLM._sample_launch
    complete       LLM._complete (read, append)   end_step       LLM._end_step (outputs)
--fine: the pieces instead (decode_inputs, sync_rows, run_host, read / read_tokens,
postprocess, sampling_rows, on_device, sample_tokens). --prefill N: instead, `--steps` calls
of `LLM.generate([prompt], max_tokens=1)` of a fresh N-token prompt through the prefill-graph
runner with its replay a stub (engine_host_time.py --prefill), per call: in all, before the
replay (the GPU idles), after it, and by phase (engine_host_time.PREFILL_PHASES).
Needs valgrind, its headers (valgrind/callgrind.h) and a C compiler: a 5-line helper is
compiled into a temporary directory to switch the collection on and off from Python (ctypes).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HELPER = """#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void cg_zero(void) { CALLGRIND_ZERO_STATS; }
void cg_dump(const char *s) { CALLGRIND_DUMP_STATS_AT(s); }
"""


class _NoValgrind:
    """The helper's calls as no-ops (--dry)."""

    def cg_start(self) -> None: ...

    def cg_toggle(self) -> None: ...

    def cg_zero(self) -> None: ...

    def cg_dump(self, _name: bytes) -> None: ...


class Collector:
    """Callgrind collects while `armed` and inside the target phase (None: everywhere) and
    outside every excluded call; the toggles follow as calls enter and leave."""

    def __init__(self, cg) -> None:
        self.cg, self.target, self.armed, self.on = cg, None, False, False
        self.inside = self.excluded = 0

    def sync(self) -> None:
        want = self.armed and (self.target is None or self.inside > 0) and not self.excluded
        if want != self.on:
            self.cg.cg_toggle()
            self.on = want

    def phase(self, name: str, f):
        def wrapped(*a, **k):
            hit = self.target == name
            if hit:
                self.inside += 1
                self.sync()
            try:
                return f(*a, **k)
            finally:
                if hit:
                    self.inside -= 1
                    self.sync()
        return wrapped

    def exclude(self, f):
        def wrapped(*a, **k):
            self.excluded += 1
            self.sync()
            try:
                return f(*a, **k)
            finally:
                self.excluded -= 1
                self.sync()
        return wrapped


def phases(fine: bool) -> list[tuple[str, object, str]]:
    from layer4_algorithms import (
        block_table_mirror,
        cuda_graph_runner,
        engine,
        engine_launch,
        launched_step,
        model_runner,
        scheduler,
    )
    if not fine:
        return [("schedule", scheduler.Scheduler, "schedule"),
                ("execute", model_runner.ModelRunner, "execute"),
                ("sample_launch", engine_launch.EngineLaunchMixin, "_sample_launch"),
                ("complete", engine.LLM, "_complete"), ("end_step", engine.LLM, "_end_step")]
    found = [("decode_inputs", model_runner, "decode_inputs"),
             ("sync_rows", block_table_mirror.BlockTableMirror, "sync_rows"),
             ("run_host", cuda_graph_runner.CudaGraphRunner, "run_host"),
             ("read", launched_step.LaunchedStep, "read"),
             ("read_tokens", launched_step.LaunchedStep, "read_tokens"),
             ("postprocess", scheduler.Scheduler, "postprocess"),
             ("sampling_rows", engine_launch.EngineLaunchMixin, "_sampling_rows"),
             ("on_device", launched_step.LaunchedStep, "on_device"),
             ("sample_tokens", model_runner.ModelRunner, "sample_tokens")]
    return [p for p in found if hasattr(p[1], p[2])]  # (a tree without one: not counted)


def measure(seqs: int, steps: int, fine: bool, cg) -> None:
    """The runs, one per phase, each ending in a dump that the parent reads back."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_host_time import tiny_model
    torch.set_num_threads(1)
    model = tiny_model(text=False)
    col = Collector(cg)
    model.net.forward = col.exclude(model.net.forward)
    table = phases(fine)
    # what each owner itself holds (a classmethod's descriptor; nothing when inherited)
    originals = [(o, a, vars(o).get(a)) for _, o, a in table] + [
        (torch.Tensor, "argmax", vars(torch.Tensor).get("argmax"))]
    torch.Tensor.argmax = col.exclude(torch.Tensor.argmax)
    for name, owner, attr in table:
        setattr(owner, attr, col.phase(name, getattr(owner, attr)))
    try:
        _runs(model, col, table, seqs, steps)
    finally:  # as they were (a test calls main() in pytest's process)
        for owner, attr, f in originals:
            if f is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, f)


def _runs(model, col: Collector, table: list, seqs: int, steps: int) -> None:
    from layer4_algorithms import LLM, CudaGraphRunner, SamplingParams

    def run(n: int, k: int, measured: bool) -> None:
        llm = LLM(model, num_blocks=n * 8 + 8, block_size=16, max_num_seqs=n,
                  max_num_batched_tokens=max(2048, n * 16), async_scheduling=True)
        c = llm.config
        graph = CudaGraphRunner(model.net, llm.cache, c.max_num_seqs,
                                -(-c.resolved_max_model_len // llm.cache.block_size),
                                capture=False)
        graph._step = col.exclude(graph._step)
        llm.runner.graph = graph
        params = SamplingParams(temperature=0.0, max_tokens=k + 40, ignore_eos=True)
        for i in range(n):
            llm.add_request([(7 * i + j) % 4000 + 50 for j in range(16)], params)
        for _ in range(4):  # the prefill and the first decode steps
            llm.step(unfinished=False)
        col.armed = measured
        col.sync()
        for _ in range(k):
            llm.step(unfinished=False)
        col.armed = False
        col.sync()

    gc.freeze()
    gc.disable()
    try:
        run(16, 3, False)  # warm: every path imported and run once
        col.cg.cg_start()  # (instrumenting from here: the imports ran at full speed)
        for target in [None] + [p[0] for p in table]:
            col.target = target
            col.cg.cg_zero()
            run(seqs, steps, True)
            col.cg.cg_dump((target or "total").encode())
    finally:
        gc.enable()
        gc.unfreeze()


def measure_prefill(tokens: int, calls: int, cg) -> None:
    """--prefill: one run of `calls` prefills per figure, each ending in a dump."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_host_time import PREFILL_PHASES, prefill_engine
    torch.set_num_threads(1)
    col = Collector(cg)
    split = {"mode": None}  # "before": collect up to the replay, "after": from it on

    def on_replay() -> None:
        if split["mode"] is not None:
            col.armed = split["mode"] == "after"
            col.sync()
    llm, vocab = prefill_engine(tokens, on_replay)
    table = [(name.replace(" ", "_"), cls, attr) for name, cls, attr in PREFILL_PHASES]
    owners = [(next(c for c in cls.__mro__ if attr in vars(c)), attr) for _, cls, attr in table]
    originals = [(o, a, vars(o)[a]) for o, a in owners]
    for (name, _, _), (owner, attr) in zip(table, owners, strict=True):
        setattr(owner, attr, col.phase(name, vars(owner)[attr]))
    from layer4_algorithms import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    figures = ["total", "before_replay", "after_replay"] + [name for name, _, _ in table]
    prompts = [torch.randint(0, vocab, (tokens,), generator=gen).tolist()
               for _ in range(3 + calls * len(figures))]
    gc.disable()  # (no gc.freeze() here: generate() freezes the heap itself when nobody has)
    try:
        for p in prompts[:3]:  # warm: every path run once
            llm.generate([p], params)
        cg.cg_start()
        left = iter(prompts[3:])
        for figure in figures:
            col.target = figure if figure not in figures[:3] else None
            split["mode"] = {"before_replay": "before", "after_replay": "after"}.get(figure)
            cg.cg_zero()
            for _ in range(calls):
                col.armed = split["mode"] != "after"
                col.sync()
                llm.generate([next(left)], params)
                col.armed = False
                col.sync()
            cg.cg_dump(figure.encode())
    finally:
        gc.enable()
        for owner, attr, f in originals:
            setattr(owner, attr, f)


def _helper(tmp: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or shutil.which("valgrind") is None:
        raise SystemExit("needs valgrind and a C compiler on PATH (apt-get install valgrind gcc)")
    src, lib = tmp / "cgctl.c", tmp / "libcgctl.so"
    src.write_text(HELPER)
    done = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(src)],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"compiling the callgrind helper failed (valgrind's headers, "
                         f"valgrind/callgrind.h, missing?):\n{done.stderr}")
    return lib


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--fine", action="store_true", help="the pieces instead of the phases")
    ap.add_argument("--dry", action="store_true", help="run the workload without valgrind")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="instead: --steps prefills of N tokens through generate, per call")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the helper's path
    args = ap.parse_args(argv)
    for name in ("seqs", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.prefill < 0:
        ap.error(f"--prefill must be >= 0, got {args.prefill}")
    if args.dry or args.child:
        cg = _NoValgrind() if args.dry else ctypes.CDLL(args.child)
        if args.prefill:
            measure_prefill(args.prefill, args.steps, cg)
        else:
            measure(args.seqs, args.steps, args.fine, cg)
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        lib = _helper(Path(tmp))
        out = Path(tmp) / "cg.out"
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
               f"--callgrind-out-file={out}", sys.executable, __file__, "--child", str(lib),
               "--seqs", str(args.seqs), "--steps", str(args.steps),
               "--prefill", str(args.prefill)] + (["--fine"] if args.fine else [])
        what = (f"{args.steps} prefills of {args.prefill} tokens (generate, max_tokens 1) a "
                "figure" if args.prefill else
                f"{args.seqs} sequences, {args.steps} decode steps a phase")
        print(f"callgrind, {what} (minutes: everything runs under valgrind)", flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        if done.returncode:
            raise SystemExit(f"valgrind run failed:\n{done.stderr[-3000:]}")
        result = {}
        for dump in sorted(Path(tmp).glob("cg.out.*"), key=lambda p: int(p.suffix[1:])):
            text = dump.read_text(errors="replace")
            name = text.split("Client Request: ", 1)[1].split("\n", 1)[0].strip()
            total = int(next(line.split()[1] for line in text.splitlines()
                             if line.startswith("summary:")))
            result[name] = total / args.steps
            if args.prefill:
                print(f"  {name:18s} {total / args.steps:12,.0f} instructions/call", flush=True)
                continue
            print(f"  {name:14s} {total / args.steps:12,.0f} instructions/step "
                  f"{total / args.steps / args.seqs:8,.0f} per sequence", flush=True)
        return result


if __name__ == "__main__":
    main()
