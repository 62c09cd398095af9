"""A step's logits -> its tokens: the sampling half of ModelRunner (model_runner.py).

Every row of a step is sampled in one go. Greedy rows (the common case: often all of them)
take one batched argmax, on a GPU layer 1's split argmax, or the argmax a decode CUDA graph
already computed (nothing launched then); the other rows go through layer 3's sampler with
each sequence's own generator, guarded so a row whose probabilities go bad is flagged
instead of failing the batch (sampling_guard.py). Rows that need penalties or logprobs go
through logits_processing.py. The tokens stay on the device until the engine reads them.
"""
from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

import numpy as np
import torch

import layer3_model as l3

from .logits_processing import TokenLogprobs, sample_processed
from .sampling_guard import sample_guarded

_TEMPERATURE = attrgetter("temperature")


class StepSampler:
    """ModelRunner's sampling methods (a mixin): they use the runner's `staging` (pinned
    host -> device copies) and set its `last_bad`."""

    staging: l3.HostStaging
    last_bad: torch.Tensor | None = None  # the last sample_tokens call's void rows

    def sample(self, logits: torch.Tensor | Sequence[torch.Tensor],
               params: Sequence[l3.SamplingParams],
               generators: Sequence[torch.Generator | None]) -> list[int]:
        """One token per row of logits ((N, V), or N rows of (V,)): greedy rows by one batched
        argmax, the rest by layer 3's sampler with each sequence's own generator. One host sync."""
        if not len(params):
            self.last_bad = None  # nothing sampled: no void rows (not the last call's)
            return []
        return self.sample_tokens(logits, params, generators).tolist()

    def sample_tokens(self, logits: torch.Tensor | Sequence[torch.Tensor],
                      params: Sequence[l3.SamplingParams],
                      generators: Sequence[torch.Generator | None], *,
                      argmax: torch.Tensor | None = None) -> torch.Tensor:
        """`sample`, the tokens left on the logits' device (N,) int64: no host sync.
        `last_bad` is then None (every row greedy) or (N,) bool on the device: rows whose
        probabilities were not a distribution (sampling_guard.py); their tokens are void.
        argmax: the rows' argmax, already computed (the decode graph's, StepLogits.argmax):
        an all-greedy step returns it as it is (nothing launched)."""
        self.last_bad = None
        # every row greedy (SamplingParams.greedy: temperature 0), the common case, checked by
        # map() over the rows (a property call a row is ~15 us at 256 rows): no gather, no scatter
        if not any(map(_TEMPERATURE, params)):
            if argmax is not None and argmax.shape[0] == len(params):
                return argmax
            x = logits if isinstance(logits, torch.Tensor) else torch.stack(list(logits))
            return greedy_tokens(x)
        x = logits if isinstance(logits, torch.Tensor) else torch.stack(list(logits))
        greedy = [i for i, p in enumerate(params) if p.greedy]
        out = torch.empty(len(params), dtype=torch.int64, device=x.device)
        other = [i for i, p in enumerate(params) if not p.greedy]
        if greedy:
            idx = self.staging.to_device(np.array(greedy, dtype=np.int64))
            out[idx] = greedy_tokens(x[idx])
        idx = self.staging.to_device(np.array(other, dtype=np.int64))
        # a row whose probabilities go bad is flagged, not raised: the others keep their tokens
        out[idx], bad = sample_guarded(x[idx], [params[i] for i in other],
                                       [generators[i] for i in other])
        self.last_bad = torch.zeros(len(params), dtype=torch.bool, device=x.device)
        self.last_bad[idx] = bad
        return out

    def sample_processed(self, logits: torch.Tensor, params: Sequence[l3.SamplingParams],
                         generators: Sequence[torch.Generator | None],
                         output_ids: Sequence[Sequence[int]]
                         ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """`sample` for rows some of which need logits processing (penalties from output_ids[i],
        the generated tokens; logprobs): (tokens, TokenLogprobs or None per row). The engine
        calls it only when a row's params need it; see logits_processing.py."""
        return sample_processed(self.sample, logits, params, generators, output_ids)


def greedy_tokens(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1): the first index of each row's maximum (NaN the largest). (N, V) rows
    on a GPU go through layer 1's split argmax (many programs a row; torch reduces a row in
    one thread block: ~27 us for a 128256-wide row, every greedy step); elsewhere torch's."""
    if (x.is_cuda and x.dim() == 2 and x.shape[1] > 0 and x.stride(-1) == 1
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        return l3.argmax(x)
    return x.argmax(dim=-1)
