"""A step's logits as the model runner returns them: one row per sampling sequence in one
tensor, a speculating sequence's rows apart, indexed by the sequence's scheduled position."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import layer3_model as l3


@dataclass
class StepLogits:
    """A step's logits. last: (R, V) fp32, the last input token's row of every sampling
    sequence; row[i]: scheduled sequence i's row in `last` (None: a prefill chunk that does
    not sample); spec[i]: a speculating sequence's (1 + len(spec_token_ids), V) rows.
    step_logits[i] is sequence i's rows: spec[i], last[row[i]:row[i] + 1] or None."""

    last: torch.Tensor
    row: list[int | None]
    spec: dict[int, torch.Tensor]
    staging: l3.HostStaging | None = None  # for rows_of's index copy (pinned, non-blocking)
    argmax: torch.Tensor | None = None  # (R,) `last`'s argmax when the decode graph made it

    def __len__(self) -> int:
        return len(self.row)

    def __getitem__(self, i: int) -> torch.Tensor | None:
        if i in self.spec:
            return self.spec[i]
        r = self.row[i]
        return None if r is None else self.last[r:r + 1]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def rows_of(self, row_ids: list[int]) -> torch.Tensor:
        """(len(row_ids), V): `last` itself when row_ids is every row in order (no copy)."""
        if len(row_ids) == self.last.shape[0] and row_ids == list(range(len(row_ids))):
            return self.last
        host = np.array(row_ids, dtype=np.int64)
        if self.staging is not None and self.staging.device.type == self.last.device.type:
            return self.last[self.staging.to_device(host)]
        return self.last[torch.from_numpy(host).to(self.last.device)]
