"""The pipeline's GPU probes (benchmarks/pp_p2p_probe.py, pp_gpu_probe.py) run their code on
the CPU first: gloo hand-offs in the pipeline's order, and one pipelined configuration."""
from __future__ import annotations

import argparse
import threading

import torch
import torch.distributed as dist

from tests.benchmark_script import load


def _two_ranks(fn) -> list:
    """fn(rank, store) on two threads (two gloo ranks in this process); their results."""
    store = dist.HashStore()
    out, errors = [None, None], []

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank, store)
        except Exception as exc:  # noqa: BLE001 - re-raised below, naming the rank
            errors.append((rank, exc))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


def test_p2p_probe_order_and_pingpong_on_gloo():
    probe = load("pp_p2p_probe")
    dev = torch.device("cpu")

    def order(rank: int, store):
        fwd = probe._group(rank, store, "gloo", "fwd", 30)
        back = probe._group(rank, store, "gloo", "back", 30)
        one = probe._order(rank, fwd, fwd, 4096, 8192, dev, 30)  # one group, as the engine
        two = probe._order(rank, fwd, back, 4096, 8192, dev, 30)
        ping = probe._pingpong(rank, fwd, dev, 3, True)
        return one, two, ping

    for one, two, ping in _two_ranks(order):
        assert one > 0 and two > 0 and ping > 0


def test_gpu_probe_runs_one_pipelined_configuration_on_cpu():
    probe = load("pp_gpu_probe")
    args = argparse.Namespace(pp=2, micro=2, graph=0, seqs=4, max_tokens=4, prompt_len=12,
                              prompt_min=6, timeout_s=60.0, timeline=None)
    threads = torch.get_num_threads()  # one() sets this process's, as each rank's
    try:
        row = probe.one(args)
        ref = probe.one(argparse.Namespace(**{**vars(args), "pp": 1, "micro": 1}))
    finally:
        torch.set_num_threads(threads)
    assert row["tokens"] == ref["tokens"] and all(len(t) == 4 for t in row["tokens"])
    assert row["tok_s"] > 0 and row["steps"] >= 4
    assert [r["rank"] for r in row["ranks"]] == [0, 1]
    assert all(0 < r["busy_s"] <= r["wall_s"] for r in row["ranks"])
