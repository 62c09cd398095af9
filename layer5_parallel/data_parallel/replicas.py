"""Data parallelism for serving: N whole engines, one per process and device, sharing requests.

    with LLM("models/course-target", data_parallel_size=2) as llm:   # a ReplicaSet
        outs = llm.generate(prompts, SamplingParams(max_tokens=64))

When the model fits one device, the fastest way to use N devices is N copies of the engine:
nothing crosses between them (no all-reduce per layer, no pipeline bubble), so throughput
scales with N as long as there are requests to spread. Each replica is a process running
layer 5's `LLM` (itself tensor- or pipeline-parallel if the config says so) on its own
device(s): GPU i for replica i on CUDA (CUDA_VISIBLE_DEVICES set before the replica touches
CUDA, so a TP=2 replica gets GPUs 2i, 2i+1), the CPU otherwise (its cores shared out).

Two ways to drive them, as layer 4's engine:
- `generate(prompts, params)`: the prompts are dealt out by the work they ask for (`deal`:
  new tokens, the largest first), every replica runs its hand at the same time, the outputs
  come back in prompt order, and `replica_stats` says what each replica did (its sequences,
  tokens, steps, seconds, and its host's share of a step: `StepClock`);
- `add_request` / `step` / `abort` / `has_unfinished`: each request goes to the replica with
  the fewest unfinished requests; a step steps every busy replica at once.
Each replica's tokens are its own engine's, so greedy outputs equal one engine's.

A replica that fails or dies is named in one RuntimeError; close() stops them all.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from dataclasses import replace
from pathlib import Path

import torch
import torch.multiprocessing as mp

import layer4_algorithms as engine

from ..engine_config import EngineConfig
from ..runtime.environ import environ
from ..runtime.group import end_processes
from ..runtime.rank0 import wait_event
from ..runtime.worker import control_messages, run_worker

l3 = engine.executor


def replica_devices(config: EngineConfig) -> list[str]:
    """The device of each replica: dp_devices, else GPUs 0.. (tp x pp each) when the machine
    has GPUs (or the config's device asks for CUDA), else the CPU. ValueError when there are
    fewer GPUs than replicas x ranks (a replica per GPU, never two on one)."""
    dp = config.data_parallel_size
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    if config.dp_devices is not None:
        return list(config.dp_devices)
    want = str(config.device or "auto")
    gpus = torch.cuda.device_count()
    if want.startswith("cuda") or (want == "auto" and gpus > 0):
        if gpus < dp * ranks:
            raise ValueError(f"data_parallel_size={dp} x {ranks} rank(s) per replica needs "
                             f"{dp * ranks} GPUs; {gpus} are visible")
        return [",".join(str(r * ranks + k) for k in range(ranks)) for r in range(dp)]
    return ["cpu"] * dp


def visible_devices(devices: str, parent: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a replica on `devices` (ordinals as this process sees them,
    "2,3"), through this process's own mask `parent` (None: every GPU)."""
    if parent is None or not parent.strip():
        return devices
    mine = [d.strip() for d in parent.split(",") if d.strip()]
    wanted = [int(d) for d in devices.split(",")]
    if any(not 0 <= d < len(mine) for d in wanted):
        raise ValueError(f"replica devices {devices!r}: this process sees {len(mine)} GPU(s) "
                         f"(CUDA_VISIBLE_DEVICES={parent!r})")
    return ",".join(mine[d] for d in wanted)


def deal(work: list[float], dp: int) -> list[list[int]]:
    """Indices of `work` dealt to dp replicas so their sums are close: the largest first, each
    to the replica with the least so far (longest-processing-time first: within 4/3 of the
    best split). Contiguous equal-count shares are not: with outputs of 100..1024 tokens the
    replica that drew the long ones sets the time while the other idles."""
    hands: list[list[int]] = [[] for _ in range(dp)]
    sums = [0.0] * dp
    for i in sorted(range(len(work)), key=lambda k: (-work[k], k)):
        r = min(range(dp), key=lambda j: (sums[j], j))
        hands[r].append(i)
        sums[r] += work[i]
    return [sorted(h) for h in hands]


def hands(prompts: list, params: list, dp: int) -> list[list[int]]:
    """Which prompts each of dp replicas runs (`deal` by new tokens to generate, the prompt's
    length breaking ties): what `ReplicaSet.generate` does, for a caller that wants to run
    one hand elsewhere (a benchmark checking a replica against one engine)."""
    work = [(getattr(p, "max_tokens", None) or 0) + len(q) / 1e6
            for p, q in zip(params, prompts, strict=True)]
    return deal(work, dp)


class StepClock:
    """Where an engine's step() time goes: its waits for a launched step's tokens (the device
    still running it) apart from the rest (host work: scheduling, input building, launches,
    outputs). Wraps the engine's `_complete`, waiting for the step's event itself first (a
    bounded wait when the engine has worker ranks, as the engine's own), so
    host = stats.elapsed_s - waited_s. Cost: two clock reads a step."""

    def __init__(self, llm) -> None:
        self.waited_s, inner = 0.0, llm._complete
        group = getattr(llm, "tp_group", None)

        def timed(launched, advanced, finished) -> None:
            event = launched.event
            if event is not None and not event.query():
                start = time.perf_counter()
                if group is not None:
                    wait_event(group, event, "reading a step's tokens")
                else:
                    event.synchronize()
                self.waited_s += time.perf_counter() - start
            inner(launched, advanced, finished)

        llm._complete = timed

    def report(self, llm, wall_s: float, sequences: int) -> dict:
        """What the engine did since its stats were reset (generate() resets them)."""
        st = llm.stats
        steps = max(st.steps, 1)
        return {"sequences": sequences, "prompt_tokens": st.prompt_tokens,
                "output_tokens": st.generated_tokens, "steps": st.steps,
                "batched_tokens": st.batched_tokens, "wall_s": wall_s, "step_s": st.elapsed_s,
                "wait_s": self.waited_s, "ms_per_step": 1e3 * wall_s / steps,
                "host_ms_per_step": 1e3 * (st.elapsed_s - self.waited_s) / steps,
                "mean_batch": st.batched_tokens / steps}


def _replica_main(index: int, devices: str, model, config: EngineConfig, threads: int,
                  conn, pdeathsig: bool = False) -> None:
    """Replica `index`: its engine over `devices` ("cpu", or CUDA ordinals "2" / "2,3"),
    serving the parent's messages until ("stop",); it dies with its parent (pdeathsig: the
    parent started it from its main thread; see runtime/worker.py's die_with_parent)."""

    def body() -> None:  # CUDA_VISIBLE_DEVICES came with the spawn: this replica's GPUs are 0..
        torch.set_num_threads(threads)
        from ..llm import LLM  # noqa: PLC0415 (a fresh process: import after the env is set)

        device = "cpu" if devices == "cpu" else "cuda"
        if callable(model) and not isinstance(model, l3.Model):
            source = model(device)  # a factory: builds the model in the replica
        else:
            source = model
        cfg = replace(config, device=device if not isinstance(source, l3.Model) else
                      config.device)
        with LLM(source, cfg) as llm:
            clock = StepClock(llm)
            conn.send(("ready", index, llm.config.num_blocks))
            parent = mp.parent_process()
            for msg in control_messages(conn, parent, f"replica {index}"):
                kind = msg[0]
                if kind == "generate":
                    clock.waited_s = 0.0
                    start = time.perf_counter()
                    outs = llm.generate(msg[1], msg[2])
                    wall = time.perf_counter() - start
                    conn.send(("outputs", outs, wall, clock.report(llm, wall, len(msg[1]))))
                elif kind == "add":
                    llm.add_request(msg[1], msg[2], request_id=msg[3])
                    conn.send(("added",))
                elif kind == "step":
                    conn.send(("outputs", llm.step(**msg[1]), llm.has_unfinished()))
                elif kind == "abort":
                    conn.send(("aborted", llm.abort(msg[1])))
                else:
                    raise ValueError(f"unknown message {kind!r}")

    run_worker(conn, body, pdeathsig=pdeathsig)


class ReplicaSet:
    """`data_parallel_size` engines in processes of their own (see the module docstring).
    ReplicaSet(model, config=None, **overrides): model is a checkpoint path, a CPU
    `l3.Model` (shared with the replicas), or a picklable factory `f(device) -> l3.Model`
    each replica calls (random-weight benchmarks)."""

    def __init__(self, model: str | Path | l3.Model, config: engine.EngineConfig | None = None,
                 *, timeout_s: float = 600.0, **overrides) -> None:
        config = EngineConfig.of(config)
        config = replace(config, **overrides) if overrides else config
        if isinstance(model, l3.Model) and config.device in (None, "auto"):
            config = replace(config, device=model.net.device.type)  # replicas follow the model
        self.config, self.timeout_s = config, timeout_s
        self.devices = replica_devices(config)
        dp = config.data_parallel_size
        per = replace(config, data_parallel_size=1, dp_devices=None)
        if isinstance(model, Path):
            model = str(model)
        threads = max(1, (os.cpu_count() or 1) // dp) if self.devices[0] == "cpu" else 1
        ctx = mp.get_context("spawn")
        self.procs, self.conns, self.error = [], [], None
        self.load = [0] * dp  # unfinished requests per replica
        self.where: dict[str, int] = {}  # request id -> replica
        self._ids = 0
        for i, dev in enumerate(self.devices):
            mine, theirs = ctx.Pipe(duplex=True)
            # not daemonic: a replica may start worker ranks of its own (TP, PP); it stops
            # by itself when this process dies (control_messages checks its parent)
            p = ctx.Process(target=_replica_main, name=f"replica{i}", daemon=False,
                            args=(i, dev, model, per, threads, theirs,
                                  threading.current_thread() is threading.main_thread()))
            mask = None if dev == "cpu" else visible_devices(
                dev, os.environ.get("CUDA_VISIBLE_DEVICES"))
            # in the environment the child starts with: set inside it, the mask came too late
            # (unpickling its arguments may import modules that already ask CUDA for devices)
            with environ(CUDA_VISIBLE_DEVICES=mask):
                p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(mine)
        self.num_blocks = [m[2] for m in self._gather(range(dp), "ready")]
        atexit.register(_close_ref, weakref.ref(self))

    @property
    def data_parallel_size(self) -> int:
        return len(self.devices)

    def __getattr__(self, name: str):
        """What layer 4's engine has and a replica set does not: one clear error."""
        if name.startswith("__") or name in ("procs", "conns", "error", "devices"):
            raise AttributeError(name)
        raise AttributeError(f"a ReplicaSet (data_parallel_size > 1) has no {name!r}: it serves "
                             "through generate / add_request / step / abort; to serve replicas "
                             "over HTTP run `stack serve --dp N` (one server per GPU behind "
                             "layer 7's router)")

    # ---- messages ------------------------------------------------------------------------------
    def _gather(self, which, kind: str) -> list[tuple]:
        """Each named replica's next reply, which must be of `kind`, within timeout_s."""
        if self.error is not None:
            raise RuntimeError(f"the replica set is closed: {self.error}")
        deadline, out = time.monotonic() + self.timeout_s, []
        for i in which:
            c, p = self.conns[i], self.procs[i]
            try:
                while not c.poll(0.1):
                    if not p.is_alive():
                        raise RuntimeError(f"replica {i} exited (code {p.exitcode})")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"replica {i} did not answer {kind!r} within "
                                           f"{self.timeout_s:g} s")
                msg = c.recv()
                if msg[0] != kind:
                    detail = msg[1].strip().splitlines()[-1] if msg[0] == "error" else msg[0]
                    raise RuntimeError(f"replica {i} on {self.devices[i]} failed: {detail}")
            except BaseException as exc:
                self.error = str(exc)
                self.close()
                raise
            out.append(msg)
        return out

    def _send(self, i: int, msg: tuple) -> None:
        if self.error is not None:
            raise RuntimeError(f"the replica set is closed: {self.error}")
        self.conns[i].send(msg)

    # ---- the offline loop ----------------------------------------------------------------------
    def generate(self, prompts, params=None, **_) -> list:
        """Every prompt to completion, the replicas each running their hand at once (dealt by
        new tokens to generate, then prompt tokens: `deal`); outputs in prompt order (each
        replica's request ids are its own)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        dealt = hands(prompts, plist, self.data_parallel_size)
        busy = [i for i, hand in enumerate(dealt) if hand]
        start = time.perf_counter()
        for i in busy:
            mine = dealt[i]
            self._send(i, ("generate", [prompts[k] for k in mine], [plist[k] for k in mine]))
        replies = self._gather(busy, "outputs")
        front_s = time.perf_counter() - start
        self.replica_seconds = {i: m[2] for i, m in zip(busy, replies, strict=True)}
        # per replica: its report, its device, and the whole call's seconds seen from here
        # (front_s - the slowest wall_s: sending prompts, pickling outputs back, stragglers)
        self.replica_stats = {i: dict(m[3], device=self.devices[i], front_s=front_s)
                              for i, m in zip(busy, replies, strict=True)}
        out: list = [None] * len(prompts)
        for i, m in zip(busy, replies, strict=True):
            for k, o in zip(dealt[i], m[1], strict=True):
                out[k] = o
        return out

    # ---- the online loop -----------------------------------------------------------------------
    def add_request(self, prompt, params=None, request_id: str | None = None) -> str:
        """Queue a prompt on the replica with the fewest unfinished requests."""
        if request_id is None:
            request_id, self._ids = f"dp-{self._ids}", self._ids + 1
        i = min(range(self.data_parallel_size), key=self.load.__getitem__)
        self._send(i, ("add", prompt, params, request_id))
        self._gather([i], "added")
        self.where[request_id] = i
        self.load[i] += 1
        return request_id

    def step(self, **kw) -> list:
        """One step of every replica with unfinished requests, at once; their outputs."""
        busy = [i for i, n in enumerate(self.load) if n > 0]
        for i in busy:
            self._send(i, ("step", kw))
        outs = []
        for i, m in zip(busy, self._gather(busy, "outputs"), strict=True):
            outs += m[1]
            for o in m[1]:
                if o.finished:
                    self.where.pop(o.request_id, None)
            self.load[i] = sum(1 for r in self.where.values() if r == i) if m[2] else 0
        return outs

    def abort(self, request_id: str):
        i = self.where.pop(request_id, None)
        if i is None:
            return None
        self._send(i, ("abort", request_id))
        self.load[i] = max(0, self.load[i] - 1)
        return self._gather([i], "aborted")[0][1]

    def has_unfinished(self) -> bool:
        return any(self.load)

    # ---- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every replica ("stop", then terminate what is left)."""
        for c in self.conns:
            try:
                c.send(("stop",))
            except OSError:
                pass
        end_processes(self.procs, time.monotonic() + 10.0)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []
        self.error = self.error or "the replica set was closed (close())"

    def __enter__(self) -> ReplicaSet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close_ref(ref: weakref.ref) -> None:
    s = ref()
    if s is not None and s.procs:
        s.close()
