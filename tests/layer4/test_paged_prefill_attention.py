"""The triton backend's prefill attention over layer 4's paged cache: keys after a cached
prefix read through shuffled block tables in place, steps that mix decodes with prompt chunks,
against the torch backend (interpreted kernels on a CPU); and one launch per layer, whatever
the number of sequences in the step (a launch per sequence made the engine's big prefills
host-bound)."""
from __future__ import annotations

import importlib

import pytest
import torch

from layer4_algorithms import PagedKVCache

from ..layer3.test_prefill_attention import SHAPE, _pair  # (same small model, torch and triton)

VARLEN = importlib.import_module("layer1_kernels.flash_attention_varlen")
PAGE = 4


class Launches:
    """Counts the varlen kernel's launches (the spy forwards each to the real kernel)."""

    def __init__(self, monkeypatch) -> None:
        self.count, real = 0, VARLEN._flash_varlen_kernel

        class Spy:
            def __getitem__(spy, grid):
                def launch(*a, **kw):
                    self.count += 1
                    return real[grid](*a, **kw)
                return launch
        monkeypatch.setattr(VARLEN, "_flash_varlen_kernel", Spy())


@pytest.mark.interpreter
def test_mixed_steps_over_shuffled_blocks_match_torch_backend(monkeypatch) -> None:
    ref, fast = _pair(2)
    launches = Launches(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    caches = [PagedKVCache.for_model(n.config, 40, PAGE, dtype=torch.float32) for n in (ref, fast)]
    free = torch.randperm(40, generator=gen).tolist()
    tables: list[list[int]] = [[], [], [], []]
    done = [0, 0, 0, 0]
    steps = ([6, 1, 13, 3], [1, 1, 5, 1], [1, 9, 1, 1], [2, 1, 1, 1])  # prefill, then mixed
    with torch.no_grad():
        for lens in steps:
            for b, n in enumerate(lens):
                while len(tables[b]) * PAGE < done[b] + n:
                    tables[b].append(free.pop())
            ids = torch.randint(0, SHAPE["vocab_size"], (sum(lens),), generator=gen)
            outs = [n(ids, c.context(lens, done, tables), c) for n, c in zip((ref, fast), caches,
                                                                             strict=True)]
            torch.testing.assert_close(outs[1], outs[0], atol=2e-4, rtol=1e-4)
            done = [d + n for d, n in zip(done, lens, strict=True)]
    # one launch per layer and step (four sequences each), none per sequence
    assert launches.count == len(steps) * SHAPE["num_hidden_layers"]
