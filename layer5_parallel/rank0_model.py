"""Rank 0's model under tensor or pipeline parallelism: what layer 4's engine holds.

The engine asks its model for config, dtype, device and backend, and calls forward(ids, ctx,
cache); here those come from rank 0's own shard (TP) or stage (PP), and forward (written by
TPModel in llm.py and PPModel in pp_engine.py) first tells the workers what to run.
"""
from __future__ import annotations

import torch
from torch import nn

from .tp_group import TPGroup


class RankZeroModel(nn.Module):
    """Holds rank 0's `shard` and the worker `group`; looks like the shard to the engine."""

    def __init__(self, shard: nn.Module, group: TPGroup) -> None:
        super().__init__()
        self.shard, self.group, self.config = shard, group, shard.config

    @property
    def dtype(self) -> torch.dtype:
        return self.shard.dtype

    @property
    def device(self) -> torch.device:
        return self.shard.device

    @property
    def backend(self) -> str:
        return self.shard.backend
