"""The engine's statistics (`LLM.stats`, `reset_stats`), kept apart from the step loop."""
from __future__ import annotations

import copy

from .kv import PrefixCacheStats
from .outputs import EngineStats, RequestOutput
from .spec import SpecCounts


class EngineStatsMixin:
    """For LLM: reads self.scheduler, self.block_manager, self.speculator; writes self._stats."""

    def reset_stats(self) -> None:
        self._stats = EngineStats()
        self.block_manager.stats = PrefixCacheStats()
        self._preemptions_before = self.scheduler.num_preemptions
        spec = self.speculator
        self._spec_before = copy.copy(spec.counts) if spec is not None else SpecCounts()

    @property
    def stats(self) -> EngineStats:
        """Counters since the last reset; preemptions, prefix-cache and speculation figures
        are read from the scheduler, block manager and speculator, which count them."""
        s, p = self._stats, self.block_manager.stats
        s.preemptions = self.scheduler.num_preemptions - self._preemptions_before
        s.prefix_queried_tokens, s.prefix_hit_tokens = p.queried_tokens, p.hit_tokens
        if self.speculator is not None:
            counts, before = self.speculator.counts, self._spec_before
            s.spec_proposed = counts.proposed - before.proposed
            s.spec_accepted = counts.accepted - before.accepted
        return s

    def _count_finished(self, o: RequestOutput) -> None:
        st = self._stats
        st.requests += 1
        st.prompt_tokens += o.metrics.num_prompt_tokens
        st.generated_tokens += sum(len(c.token_ids) for c in o.outputs)
        st.ttfts.append(o.metrics.ttft)
        if o.metrics.tpot is not None:
            st.tpots.append(o.metrics.tpot)
