"""Rank 0's model runner under pipeline parallelism: greedy steps get token ids, not logits.

Layer 4's runner returns a step's logits and the engine samples them on rank 0. In a
pipeline those logits are made on the last stage and cross to rank 0 every step: (rows, V)
values (a 128k vocabulary: 250 KB a row in bf16, 33 MB for 128 rows), which rank 0 then
widens to fp32 and reduces to one argmax a row. When every sequence of a step is greedy and
nothing reads its logits beyond the argmax (`greedy_ids`), the last stage takes the argmax
itself and sends back one int64 a row: the runner returns those ids where the logits would
be, (rows,) int64, and `sample_tokens` passes them through. The tokens are the same: the
argmax of the same values (layer 4's `greedy_tokens`, first maximum first; widening bf16 to
fp32 changes no value). Any other step (sampled rows, logprobs, penalties, a grammar,
speculation) gets its logits as before.

With stage graphs and one rank a stage, the runner's `graph` is a `StageDecode`: layer 4's
runner hands a decode step's host arrays (positions, block table) to a CUDA graph runner's
`run_host` instead of building an AttentionContext (numpy, then a copy to the device: at 128
sequences about as long as the rest of the step's launch), and StageDecode passes them to
PPModel.decode_host: the table to the other stages in the step's message, rank 0's stage
replayed from the arrays.
"""
from __future__ import annotations

import torch

from ..runtime import RankZeroRunner


def greedy_ids(out) -> bool:
    """Whether a scheduled step's tokens can be its logits' argmax taken on the last stage:
    every sequence greedy, with nothing that reads the logits beyond the argmax (logprobs,
    penalties, a grammar's mask, speculation's verification)."""
    seen = None  # (requests share one SamplingParams object more often than not)
    for s in out.scheduled:
        seq = s.seq
        p = seq.params
        if p is not seen:
            if not p.greedy or p.needs_logits_processing:
                return False
            seen = p
        if seq.grammar is not None or s.spec_token_ids:
            return False
    return bool(out.scheduled)


class PPRunner(RankZeroRunner):
    """Layer 4's runner over a PPModel (rank 0's stage 0): a greedy step's "logits" are the
    last stage's token ids (see the module docstring)."""

    def execute(self, out, prev_tokens: torch.Tensor | None = None):
        net = self.net
        net.greedy = greedy_ids(out)
        try:
            return super().execute(out, prev_tokens)
        finally:
            net.greedy = False

    def sample_tokens(self, logits, params, generators, *, argmax=None) -> torch.Tensor:
        """Layer 4's; int64 "logits" are the last stage's argmax already (every row greedy):
        they are the tokens."""
        if isinstance(logits, torch.Tensor) and logits.dtype == torch.int64:
            self.last_bad = None
            return logits.reshape(-1)
        return super().sample_tokens(logits, params, generators, argmax=argmax)


class StageDecode:
    """What layer 4's runner takes for its decode CUDA graph (`runner.graph`), over a PPModel
    with stage graphs: can_run / run_host / tokens / release. run_host is the PPModel's
    decode_host (its own graphs replay on every rank); the step's greedy tokens, when the last
    stage took them, are what run_host returns (int64), so `tokens` has none to add (empty:
    layer 4 uses it only when it holds a token a row)."""

    graphs: dict = {}  # (none of layer 4's own)

    def __init__(self, net) -> None:
        self.net = net
        self._none = torch.empty(0, dtype=torch.int64, device=net.device)

    def can_run(self, batch: int, num_blocks: int) -> bool:
        return self.net.decode_fits(batch, num_blocks)

    def run_host(self, input_ids, positions, block_tables, gather=None) -> torch.Tensor:
        return self.net.decode_host(input_ids, positions, block_tables, gather)

    def run(self, *args, **kwargs):
        raise ValueError("a decode step's block table is too short for its positions")

    def tokens(self, B: int) -> torch.Tensor:
        return self._none

    def release(self) -> None:
        pass
