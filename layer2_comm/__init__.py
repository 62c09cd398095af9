"""Layer 2 — communication: process groups and collectives built from point-to-point messages.

Process groups: `init()` joins the group described by the environment (env://, so it
works under `torchrun`, on one machine or many); NCCL on GPUs, gloo on CPUs. `launch(fn,
world_size)` runs a function on N local ranks for tests, demos and labs, with a timeout.

Collectives, each built from isend/irecv (never from torch.distributed's own
collectives), for any tensor size, float and integer dtypes, ops "sum", "max" and "avg":
- ring_all_reduce (reduce-scatter + all-gather, optionally pipelined in chunks),
- tree_all_reduce (recursive doubling; any world size),
- ring_all_gather, ring_reduce_scatter,
- broadcast_tree (binomial) and broadcast_chain (pipelined),
- all_to_all (uneven splits),
- hierarchical_all_reduce (within nodes, across node leaders, back down).
Before moving data each collective swaps a small header with its peers, so ranks that
disagree on size, dtype or arguments get a ValueError naming both, never a hang or garbage.

On GPUs joined by NVLink, `PeerAllReduce` is an all-reduce of our own over peer memory
(torch symmetric memory buffers, Triton kernels, cross-GPU flags; capturable in CUDA graphs):
one-shot for small messages, two-shot for larger ones, NCCL above its buffer, chosen by size.
The same two algorithms over simulated ranks on a CPU (`PeerBuffers`, `one_shot_all_reduce`,
`two_shot_all_reduce`, with race detection and byte counts) are what lab 2 teaches.

Measuring: an alpha-beta cost model per algorithm (`predict`, `crossover`, `fit_alpha_beta`),
nccl-tests-style sweeps with algbw and busbw (`sweep`, `ping_pong`, `busbw`), compute /
communication overlap (`overlap_demo`) and NCCL driven directly through CuPy (`nccl_example`).

The layer beneath is `kernels` (layer 1, as a namespace): layer 3 writes `kernels.rms_norm`,
`kernels.flash_attention`. Layer 0's tools (`time_fn`, `load_ceilings`, `results_dir`,
`run_command`, ...) come up from layer 1 by name and are passed on by name.
"""
import layer1_kernels as kernels  # the layer beneath, as a namespace: kernels.rms_norm

from .all_to_all import all_to_all
from .bench_bandwidth import ping_pong, sweep
from .chain import broadcast_chain
from .cost_model import AlphaBeta, busbw, crossover, fit_alpha_beta, predict
from .group import destroy, device, free_port, init, local_rank, rank, world_size
from .hierarchical import hierarchical_all_reduce
from .launch import launch
from .nccl_raw import nccl_example
from .overlap import overlap_demo
from .p2p import OPS, segment_bounds
from .peer_all_reduce import PeerAllReduce
from .ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from .simulated import PeerBuffers, RaceError, one_shot_all_reduce, two_shot_all_reduce
from .tree import broadcast_tree, tree_all_reduce

# layer 0's tools, from layer 1 by name, passed up by name for the layers above
time_fn, Timing = kernels.time_fn, kernels.Timing
load_ceilings, Ceilings = kernels.load_ceilings, kernels.Ceilings
DATASHEETS, system_info = kernels.DATASHEETS, kernels.system_info
results_dir, run_command = kernels.results_dir, kernels.run_command

__all__ = [
    # process groups
    "init", "destroy", "rank", "world_size", "local_rank", "device", "launch", "free_port",
    # collectives from point-to-point messages
    "ring_all_reduce", "tree_all_reduce", "ring_all_gather", "ring_reduce_scatter",
    "broadcast_tree", "broadcast_chain", "all_to_all", "hierarchical_all_reduce",
    "OPS", "segment_bounds",
    # all-reduce over NVLink peer memory, and its algorithms over simulated ranks
    "PeerAllReduce", "PeerBuffers", "RaceError", "one_shot_all_reduce", "two_shot_all_reduce",
    # cost model, bandwidth sweeps, overlap, raw NCCL
    "AlphaBeta", "predict", "crossover", "fit_alpha_beta", "busbw",
    "sweep", "ping_pong", "overlap_demo", "nccl_example",
    # the layer beneath (layer 1), as a namespace, and layer 0's tools passed up by name
    "kernels",
    "time_fn", "Timing", "load_ceilings", "Ceilings", "DATASHEETS", "results_dir", "system_info",
    "run_command",
]
