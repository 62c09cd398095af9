"""What a tensor-parallel block pays after each row-parallel projection, per call, on GPUs:
the all-reduce, layer 1's RMSNorm (with the residual add), both in a row, and the fused
kernel that does both (PeerAllReduce.all_reduce_rms_norm).

    python benchmarks/peer_norm_bench.py [--worlds 4,2] [--hidden 4096] [--rows 1,32]

Each contender is captured in a CUDA graph of `per_graph` back-to-back calls (as decode
replays them) and the graph replayed; time per call = replay / per_graph, the median of the
slowest rank (layer 2's bench_peer method). bf16, Llama-3.1-8B's hidden size by default.
The fused result is checked against the two launches before it is timed. Prints a line per
(world, rows), flushed.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

T0 = time.monotonic()


def _rank(hidden: int, rows_list: list[int], per_graph: int, iters: int) -> list[str]:
    import torch.distributed as dist

    import layer1_kernels as kernels
    from layer2_comm import PeerAllReduce
    from layer2_comm.bench_peer import _graph_time

    dev = torch.device("cuda", torch.cuda.current_device())
    ar = PeerAllReduce(device=dev)
    lines = []
    for rows in rows_list:
        g = torch.Generator(device=dev).manual_seed(dist.get_rank() + 17 * rows)
        x = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16, generator=g)
        r = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16, generator=g)
        w = torch.ones(hidden, device=dev, dtype=torch.bfloat16)
        fused_y, fused_h = ar.all_reduce_rms_norm(x, r, w, 1e-5)
        two_y, two_h = kernels.rms_norm(ar(x), w, eps=1e-5, residual=r)
        ok = torch.equal(fused_h, two_h) and torch.allclose(fused_y.float(), two_y.float(),
                                                            rtol=1.6e-2, atol=1.6e-2)
        out = torch.empty_like(x)
        times = {
            "all-reduce": _graph_time(lambda: ar(x, out), per_graph, iters, dev),
            "rms_norm": _graph_time(lambda: kernels.rms_norm(x, w, eps=1e-5, residual=r),
                                    per_graph, iters, dev),
            "all-reduce + rms_norm": _graph_time(
                lambda: kernels.rms_norm(ar(x, out), w, eps=1e-5, residual=r), per_graph, iters,
                dev),
            "fused": _graph_time(lambda: ar.all_reduce_rms_norm(x, r, w, 1e-5), per_graph,
                                 iters, dev),
        }
        lines.append(f"world {dist.get_world_size()} rows {rows} x {hidden} bf16 "
                     f"({rows * hidden * 2 // 1024} KiB): "
                     + ", ".join(f"{k} {1e6 * v:.2f} us" for k, v in times.items())
                     + f"; fused saves {1e6 * (times['all-reduce + rms_norm'] - times['fused']):.2f}"
                     f" us a call; fused == two launches: {'yes' if ok else 'NO'}")
    ar.close()
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="4,2")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--per-graph", type=int, default=20)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    from layer2_comm import launch

    for world in (int(w) for w in args.worlds.split(",")):
        if world > torch.cuda.device_count():
            print(f"world {world}: only {torch.cuda.device_count()} GPUs, skipped", flush=True)
            continue
        lines = launch(_rank, world, args.hidden, [int(r) for r in args.rows.split(",")],
                       args.per_graph, args.iters, backend="nccl", timeout_s=120)[0]
        for line in lines:
            print(f"[peer-norm +{time.monotonic() - T0:6.1f} s] {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
