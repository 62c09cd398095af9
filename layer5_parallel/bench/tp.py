"""Benchmarks of the engine under tensor parallelism (`stack bench --layer 5` runs them).

- `bench_tp1_vs_layer4`: the same workload through layer 4's `LLM` and layer 5's at
  tensor_parallel_size=1, alternated, best of `repeats` each: layer 5 must cost nothing
  (target: tokens/s >= 97 % of layer 4's). On a GPU: a Llama-3.2-1B-shaped model with
  random bf16 weights (said so); on a CPU: the course model in fp32.
- `bench_tp`: TP=1 vs TP=N (gloo ranks on a CPU, NCCL on GPUs) on one workload: tokens/s,
  identical greedy tokens, the share of rank 0's step time spent inside collectives, and the
  planner's predicted decode step next to the measured one.
"""

from __future__ import annotations

import time

import torch

import layer4_algorithms as engine

from .. import planner
from ..llm import LLM
from ..tensor_parallel.shard import check_tp_size

l3 = engine.executor


def workload(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """n prompts of random token ids, lengths uniform in [lo, hi] (nano-vllm's benchmark)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]


def _throughput(llm, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    params = l3.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if llm.model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    if llm.model.device.type == "cuda":
        torch.cuda.synchronize()
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, tokens)) / (time.perf_counter() - start), tokens


def _model(device: str) -> tuple[l3.Model, str]:
    if device.startswith("cuda"):
        config = l3.ModelConfig.from_dict(l3.LLAMA_3_2_1B)
        net = l3.random_model(config, dtype=torch.bfloat16, device=device)
        return l3.Model(net), "Llama-3.2-1B shape, random bf16 weights"
    return l3.load(
        l3.course_model_dir("target"), dtype="float32", device=device
    ), "course model fp32"


def bench_tp1_vs_layer4(
    device: str = "cpu",
    *,
    repeats: int = 3,
    num_prompts: int | None = None,
    max_tokens: int | None = None,
) -> dict:
    """Layer 4's engine vs layer 5's at TP=1 on one model and workload (alternated runs)."""
    gpu = device.startswith("cuda")
    model, what = _model(device)
    n = num_prompts or (64 if gpu else 8)
    m = max_tokens or (128 if gpu else 16)
    prompts = workload(n, model.config.vocab_size, 64 if gpu else 8, 512 if gpu else 48)
    blocks = sum(-(-(len(p) + m) // 16) for p in prompts) + 8
    engines = {
        "layer4": engine.LLM(model, num_blocks=blocks),
        "layer5_tp1": LLM(model, num_blocks=blocks, tensor_parallel_size=1),
    }
    for llm in engines.values():  # warm-up (kernels, allocator) on a few prompts
        _throughput(llm, prompts[:4], 4)
    best = {k: 0.0 for k in engines}
    tokens = {}
    for _ in range(repeats):
        for k, llm in engines.items():
            tps, tokens[k] = _throughput(llm, prompts, m)
            best[k] = max(best[k], tps)
    return {
        "model": what,
        "device": device,
        "prompts": n,
        "max_tokens": m,
        "layer4_tok_s": best["layer4"],
        "layer5_tp1_tok_s": best["layer5_tp1"],
        "ratio": best["layer5_tp1"] / best["layer4"],
        "same_tokens": tokens["layer4"] == tokens["layer5_tp1"],
    }


def bench_tp(
    tp: int = 2,
    device: str = "cpu",
    *,
    tp_backend: str = "torch",
    num_prompts: int = 8,
    max_tokens: int = 16,
) -> dict:
    """TP=1 vs TP=tp on the course model (fp32): throughput, equality, comm share, planner check."""
    path = l3.course_model_dir("target")
    check_tp_size(l3.ModelConfig.from_pretrained(path), tp)  # before anything starts
    prompts = workload(num_prompts, 4096, 8, 48, seed=1)
    kw = dict(
        dtype="float32",
        device=device,
        num_blocks=sum(-(-(len(p) + max_tokens) // 16) for p in prompts) + 8,
    )
    ref = LLM(path, **kw)
    tps1, tok1 = _throughput(ref, prompts, max_tokens)
    tps1, tok1 = _throughput(ref, prompts, max_tokens)  # the second run: warm
    steps1 = ref.stats.steps
    with LLM(path, tensor_parallel_size=tp, tp_backend=tp_backend, **kw) as llm:
        _throughput(llm, prompts[:2], 2)  # warm-up
        comm = llm.tp_group.comm
        before = comm.seconds, comm.calls, comm.bytes
        tpsn, tokn = _throughput(llm, prompts, max_tokens)
        elapsed, steps = llm.stats.elapsed_s, llm.stats.steps
        memory = llm.rank_memory()
        comm_s, calls, nbytes = (
            comm.seconds - before[0],
            comm.calls - before[1],
            comm.bytes - before[2],
        )
    hw = planner.hardware_for("cpu" if device == "cpu" else "h100")
    context = sum(len(p) for p in prompts) // len(prompts) + max_tokens // 2
    config = l3.ModelConfig.from_pretrained(path)
    pred = planner.cost(config, hw, tp, 1, 1, batch=num_prompts, context=context, nbytes=4)
    return {
        "tp": tp,
        "device": device,
        "backend": tp_backend,
        "tp1_tok_s": tps1,
        "tp_tok_s": tpsn,
        "speedup": tpsn / tps1,
        "same_tokens": tok1 == tokn,
        "steps": steps,
        "steps_tp1": steps1,
        "step_ms": 1e3 * elapsed / steps,
        "comm_share": comm_s / elapsed,
        "collectives_per_step": calls / steps,
        "comm_bytes_per_step": nbytes / steps,
        "memory": memory,
        "predicted_step_ms": 1e3 * pred.step_s,
        "predicted_comm_ms": 1e3 * pred.tp_comm_s,
    }


class _Timed:
    """Wraps a model's forward to add up the seconds spent in it (rank 0's view)."""

    def __init__(self, net) -> None:
        self.net, self.inner, self.seconds = net, net.forward, 0.0
        net.forward = self

    def __call__(self, *args, **kw):
        start = time.perf_counter()
        try:
            return self.inner(*args, **kw)
        finally:
            self.seconds += time.perf_counter() - start


def step_breakdown(
    tp: int = 2,
    *,
    num_prompts: int = 8,
    max_tokens: int = 16,
    tp_threads: int | None = None,
    rank0_threads: int | None = None,
    tp1_threads: int | None = None,
) -> dict:
    """Where a CPU step goes, TP=1 vs TP=tp (course model, fp32, gloo): per step, rank 0's
    engine host work (scheduling, sampling: step minus forward), the forward's compute, its
    collectives (all-reduces + the logits' all-gather, waiting for the slower rank included)
    and its control messages (the pipe message + the step's broadcast). tp_threads: threads
    per rank (None: cores // tp); rank0_threads: override rank 0's afterwards (the old
    behaviour kept all cores: pass os.cpu_count()); tp1_threads: TP=1's (None: as it is)."""
    path = l3.course_model_dir("target")
    prompts = workload(num_prompts, 4096, 8, 48, seed=1)
    kw = dict(dtype="float32", num_blocks=sum(-(-(len(p) + max_tokens) // 16) for p in prompts) + 8)
    rows = {}
    threads_before = torch.get_num_threads()
    for size in (1, tp):
        llm = LLM(path, tensor_parallel_size=size, tp_threads=tp_threads, **kw)
        try:
            if size > 1 and rank0_threads:
                torch.set_num_threads(rank0_threads)
            if size == 1 and tp1_threads:
                torch.set_num_threads(tp1_threads)
            _throughput(llm, prompts[:2], 2)  # warm-up
            timer = _Timed(llm.runner.net)
            group = llm.tp_group
            comm = group.comm if group else None
            c0 = dict(comm.seconds_by) if comm else {}
            ctl0 = group.control_s if group else 0.0
            tps, tokens = _throughput(llm, prompts, max_tokens)
            steps, elapsed = llm.stats.steps, llm.stats.elapsed_s  # generate() resets them
            coll = ctl = 0.0
            if comm:
                d = {k: comm.seconds_by[k] - c0[k] for k in c0}
                coll, ctl = d["all_reduce"] + d["all_gather"], d["broadcast"]
                ctl += group.control_s - ctl0
            ms = 1e3 / steps
            rows[size] = {
                "tok_s": tps, "steps": steps, "step_ms": elapsed * ms,
                "host_ms": (elapsed - timer.seconds) * ms,
                "compute_ms": (timer.seconds - coll - ctl) * ms,
                "collectives_ms": coll * ms, "control_ms": ctl * ms,
                "rank0_threads": torch.get_num_threads(), "tokens": tokens,
            }
        finally:
            if size > 1:
                llm.close()
            torch.set_num_threads(threads_before)
    same = rows[1].pop("tokens") == rows[tp].pop("tokens")
    return {"tp": tp, "same_tokens": same, "tp1": rows[1], f"tp{tp}": rows[tp]}
