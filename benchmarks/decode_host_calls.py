"""The host cost of a graph-replayed decode step's own calls, on this machine's CPU.

    PYTHONPATH=<tree> python benchmarks/decode_host_calls.py [--batches 1,32] [--n 3000]
                                                             [--device cuda]

Times, with CPU tensors (thread CPU time, the best of 5 rounds of --n calls each), the calls
rank 0 makes around a decode step's CUDA-graph replay, the replay itself left out:
  run_host     CudaGraphRunner.run_host through host arrays and copies (GraphInputs with
               copies=True: the GPU's path, without pinning or events), input ids from the
               last step's tokens (steady decoding: same sequences, same order, same tables)
  sample       ModelRunner.sample_tokens of an all-greedy batch as the engine calls it after a
               graph-replayed step (with the graph's argmax where the runner has one)
What a GPU adds on top (CUDA API calls: copies, events, pinned allocations) is not here:
--device cuda measures it, on the GPU's own path (pinned buffers, events; the replay still
left out), per call, host CPU and wall microseconds:
  run_host, table same / changed   steady decoding, ids on the device (the last step's)
  run_host, host ids               ids from the host in the context's copy (sync steps, lanes)
  run_host, gathered ids           ids reordered from the last step's, the index in that copy
  staging ids + run_host           a host-ids step with its ids copied on their own first (before)
  pinned copy / event record / event sync (done) / gather launch / token copy back:
                                   the CUDA calls these are made of
Run it once per tree to compare two versions.
"""
from __future__ import annotations

import argparse
import inspect
import time

import numpy as np
import torch

import layer3_model as l3
from layer4_algorithms import PagedKVCache
from layer4_algorithms.cuda_graph_runner import CudaGraphRunner
from layer4_algorithms.model_runner import ModelRunner

CONFIG = l3.ModelConfig(model_type="llama", vocab_size=4096, hidden_size=64,
                        intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)


def best(fn, n: int, rounds: int = 5) -> float:
    """Microseconds per call: the best round's mean (thread CPU time)."""
    out = []
    for _ in range(rounds):
        t = time.thread_time()
        for _ in range(n):
            fn()
        out.append((time.thread_time() - t) / n * 1e6)
    return min(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.device == "cuda":
        return gpu_calls([int(b) for b in args.batches.split(",")], args.n)
    model = l3.random_model(CONFIG, seed=0)
    for B in (int(b) for b in args.batches.split(",")):
        cache = PagedKVCache.for_model(CONFIG, 64 * B + 8, 16, dtype=torch.float32,
                                       device="cpu")
        runner = CudaGraphRunner(model, cache, max(B, 8), 64, capture=False, copies=True)
        runner._replay = lambda bucket: None  # the replay is the GPU's: left out
        pos = np.arange(B, dtype=np.int64) * 7 + 100
        table = np.arange(B * 12, dtype=np.int64).reshape(B, 12)
        tokens = getattr(runner, "tokens", None)
        ids = tokens(B) if tokens else runner.input_ids[:B]  # steady: last step's tokens
        t_run = best(lambda r=runner, i=ids, p=pos, t=table: r.run_host(i, p, t), args.n)
        params = [l3.SamplingParams(temperature=0.0)] * B
        gens = [None] * B
        logits = torch.randn(B, CONFIG.vocab_size)
        mr = ModelRunner.__new__(ModelRunner)
        mr.last_bad = None
        kw = {"argmax": ids} if "argmax" in inspect.signature(mr.sample_tokens).parameters else {}
        t_sample = best(
            lambda m=mr, x=logits, p=params, g=gens, k=kw: m.sample_tokens(x, p, g, **k), args.n)
        print(f"batch {B:3}: run_host {t_run:6.1f} us, sample (all greedy) {t_sample:6.1f} us "
              f"(CPU, replay and argmax kernel excluded{'' if kw else '; argmax on the host'})",
              flush=True)


def timed(fn, n: int, rounds: int = 5) -> tuple[float, float]:
    """(cpu, wall) microseconds per call: the best round's means; the GPU drained first."""
    cpu, wall = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t, w = time.thread_time(), time.perf_counter()
        for _ in range(n):
            fn()
        cpu.append((time.thread_time() - t) / n * 1e6)
        wall.append((time.perf_counter() - w) / n * 1e6)
    return min(cpu), min(wall)


def gpu_calls(batches: list[int], n: int) -> None:
    """--device cuda: the GPU path's host calls (see the module docstring)."""
    dev = torch.device("cuda")
    model = l3.random_model(CONFIG, seed=0, device=dev)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}: host us per call "
          "(cpu / wall), the replay left out", flush=True)
    for B in batches:
        for name, fn in gpu_rows(model, B).items():
            cpu, wall = timed(fn, n)
            print(f"  batch {B:3}  {name:24} {cpu:7.1f} / {wall:7.1f}", flush=True)


def gpu_rows(model, B: int) -> dict:
    """The calls timed at batch B: name -> a call."""
    dev = model.device
    cache = PagedKVCache.for_model(CONFIG, 64 * B + 8, 16, dtype=torch.float32, device=dev)
    runner = CudaGraphRunner(model, cache, max(B, 8), 64, capture=False)
    runner._replay = lambda bucket: None
    pos = np.arange(B, dtype=np.int64) * 7 + 100
    tables = [np.arange(B * 12, dtype=np.int64).reshape(B, 12) + k for k in (0, 1)]
    ids, host_ids = runner.tokens(B), np.arange(B, dtype=np.int64)
    staging = l3.HostStaging(dev)
    turn = [0]

    def changed():
        turn[0] ^= 1
        runner.run_host(ids, pos, tables[turn[0]])

    def staged():
        staging.next_step()
        runner.run_host(staging.to_device(host_ids), pos, tables[0])

    pinned = torch.zeros(3 * max(B, 8), dtype=torch.int64, pin_memory=True)
    dst = torch.zeros(pinned.shape, dtype=torch.int64, device=dev)
    event = torch.cuda.Event()
    event.record()
    idx = torch.arange(B, device=dev)
    idx_np = np.arange(B, dtype=np.int64)[::-1].copy()
    tokens = torch.zeros(B, dtype=torch.int64, device=dev)
    back = torch.zeros(B, dtype=torch.int64, pin_memory=True)
    return {
        "run_host, table same": lambda: runner.run_host(ids, pos, tables[0]),
        "run_host, table changed": changed,
        "run_host, host ids": lambda: runner.run_host(host_ids, pos, tables[0]),
        "run_host, gathered ids": lambda: runner.run_host(tokens, pos, tables[0], idx_np),
        "staging ids + run_host": staged,
        "pinned copy": lambda: dst.copy_(pinned, non_blocking=True),
        "event record": event.record,
        "event sync (done)": event.synchronize,
        "gather launch": lambda: tokens[idx],
        "token copy back": lambda: back.copy_(tokens, non_blocking=True),
    }

if __name__ == "__main__":
    main()
