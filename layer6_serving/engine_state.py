"""What the engine loop tracks and reports: a request's state, the engine's snapshot after
each turn, a finished request's timings, the two ways a request can fail in the loop, and
the facts about an engine the server checks requests against (EngineInfo)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from .streams import DeltaTracker


class RequestTimeoutError(Exception):
    """The request ran past its timeout; it was aborted and its blocks freed."""


class EngineStepError(RuntimeError):
    """The engine failed in a step; every request it was running was aborted."""


class EngineUnavailable(EngineStepError):
    """The engine is not serving now (its process died and is being restarted): HTTP 503."""


class SamplingError(EngineStepError):
    """This request's row could not be sampled (nan / inf probabilities); it alone ended."""


@dataclass
class EngineInfo:
    """What the server side needs to know about an engine, wherever it runs: the tokenizer
    (None: token ids only) and the limits requests are checked against up front."""

    tokenizer: object
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    speculative: bool

    @classmethod
    def of(cls, llm) -> EngineInfo:
        bm = llm.block_manager
        return cls(llm.model.tokenizer, llm.model.config.vocab_size, llm.max_model_len,
                   bm.num_blocks, bm.block_size, llm.scheduler.max_num_seqs,
                   llm.speculator is not None)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass
class Request:
    """A request as the loop tracks it (the fields after `queue` are the loop's own)."""

    request_id: str
    prompt_ids: list[int]
    params: object  # layer 4's SamplingParams (penalties and logprobs included)
    priority: int
    deadline: float | None
    loop: asyncio.AbstractEventLoop | None  # None in an engine process (the pipe delivers)
    queue: asyncio.Queue | None
    tracker: DeltaTracker
    arrival: float = field(default_factory=time.perf_counter)
    order: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    last_token_time: float | None = None
    itls: list[float] = field(default_factory=list)


@dataclass
class EngineSnapshot:
    """The engine's state after a turn: gauges (what holds now) and counters (totals since
    the loop started)."""

    steps: int = 0  # counter: engine steps taken
    running: int = 0  # gauge: sequences in the engine holding KV blocks
    waiting: int = 0  # gauge: sequences in the engine's waiting queue (no seat yet)
    requests: int = 0  # gauge: requests in the engine (running or waiting)
    kv_blocks_used: int = 0  # gauge: KV-cache blocks held by sequences
    kv_blocks_total: int = 0  # the engine's KV-cache blocks, used or free
    prompt_tokens: int = 0  # counter: prompt tokens of the requests taken in
    generation_tokens: int = 0  # counter: tokens delivered to requests
    prefix_queried_tokens: int = 0  # counter: prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # counter: of those, tokens found there (not computed again)
    spec_proposed: int = 0  # counter: draft tokens proposed by speculation
    spec_accepted: int = 0  # counter: of those, tokens the target accepted
    preemptions: int = 0  # counter: sequences preempted (blocks freed, recomputed later)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def spec_acceptance(self) -> float | None:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else None


@dataclass
class FinishedRequest:
    """A finished (or aborted) request's timings, for the metrics listeners."""

    ttft_s: float | None
    e2e_s: float
    queue_s: float | None
    itls: list[float]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
