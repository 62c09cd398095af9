"""Random weights of a real model's shape, drawn on the device by every rank from one seed.

Benchmarks of the 1B and 8B shapes use random weights (their speed does not depend on the
values). Handing rank 0's 16 GB to each worker (CUDA IPC handles through the spawn pickle;
the worker then copies them to its GPU, keeping a context and rank 0's memory mapped on GPU 0
for its whole life) or drawing them on the CPU in fp32 (layer 3's random_model: minutes for
the 8B shape) makes start-up the slow part. Instead each rank draws the same weights itself:
the same generator, seeded alike, drawing the same tensors in the same order gives the same
values on every device of a kind. A net made here carries `worker_source`, which layer 5's
engine passes to its workers instead of the net's tensors (worker.load_full draws them).
"""
from __future__ import annotations

import torch

import layer4_algorithms as engine

l3 = engine.executor


def random_net(config, *, backend: str = "torch", dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cpu", seed: int = 0,
               std: float = 0.02) -> torch.nn.Module:
    """A layer-3 LlamaModel of `config`'s shape with N(0, std) weights (norm weights 1) in
    `dtype`, drawn on `device` by a generator seeded with `seed`. Its `worker_source`,
    ("random", config, backend, dtype, seed, std), makes a worker draw the same net."""
    device = torch.device(device)
    with l3.meta_device():
        net = l3.LlamaModel(config, backend=backend)
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, t in net.state_dict().items():
        w = torch.empty(t.shape, dtype=dtype, device=device)
        state[name] = w.fill_(1.0) if name.endswith("norm.weight") else \
            w.normal_(0.0, std, generator=gen)
    net.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        net.lm_head.weight = net.embed.weight
    net.init_rope(device)
    net.worker_source = ("random", config, backend, dtype, seed, std)
    return net.eval()
