"""AsyncEngine: one model's engine, served to asyncio code.

    engine = AsyncEngine("course", max_tokens_default=64)
    stream = await engine.generate("ROMEO.\\n", SamplingParams(temperature=0, max_tokens=32))
    async for out in stream:                 # StreamOutput: deltas of one engine step
        print(out.deltas[0].text, end="")
    final = await (await engine.generate(prompt, params)).collect()   # or all at once

Why not the event loop: a step is a blocking forward pass (tens of ms); on the event loop it
would stall every HTTP connection for that long. The engine lives in one thread
(engine_loop.py) that nothing else touches, or, with engine_process=True, in a process of
its own (engine_process.py: no GIL shared with the HTTP work, what `stack serve` runs); the
event loop only enqueues commands and awaits per-request queues. `generate` checks the
request before queueing it (ValueError: empty prompt, prompt + max_tokens over the context,
more KV than the whole pool) and applies backpressure (EngineOverloaded when more than
`max_waiting` requests wait for admission).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import time
from collections.abc import Sequence as Seq
from pathlib import Path

import layer5_parallel as l5

from .engine_loop import EngineLoop
from .engine_process import EngineProcess
from .engine_state import EngineInfo, EngineSnapshot, Request
from .engine_worker import bound_cpu_kernel_caches
from .request_stream import RequestStream
from .streams import DeltaTracker

COURSE = "course"
TIMEOUT_GRACE_S = 0.5  # the engine expires a request first; the server after this much more


class EngineOverloaded(Exception):
    """Too many requests wait for admission; retry after `retry_after` seconds (HTTP 429)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def resolve_model(model: str | Path) -> str | Path:
    """"course" -> the course model's directory; anything else goes to the loader as is."""
    if str(model) == COURSE:
        return l5.course_model_dir("target")
    return model


class AsyncEngine:
    """model: "course", a checkpoint path (or a name layer 3's loader knows), or a built
    `LLM`. engine_kwargs go to `LLM` (num_blocks, max_num_seqs, ...; tensor_parallel_size
    when above 1). max_waiting: how many requests may wait for a seat (backpressure).
    request_timeout: default seconds per request (None: none). policy: "fcfs" or "priority"
    (the engine's scheduler orders by it: built here, it is told so; a built LLM must
    schedule by priority already). chat_stop: stop strings added to chat requests
    (the course model ends a speech at a blank line). engine_process: build and run the
    engine in a spawned process (`llm` is then None: `info` says what the server needs),
    restarted when it dies (at most max_restarts failures in a row). stall_timeout: seconds
    without a turn, with requests open, before the engine counts as stalled (`problem`)."""

    def __init__(self, model: str | Path | l5.LLM = COURSE, *, name: str | None = None,
                 max_waiting: int = 512, request_timeout: float | None = None,
                 policy: str = "fcfs", chat_stop: Seq[str] | None = None,
                 engine_process: bool = False, stall_timeout: float = 5.0,
                 max_restarts: int = 3, **engine_kwargs) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
        self._owns_llm = not isinstance(model, l5.engine.LLM)
        if engine_process and not self._owns_llm:
            raise ValueError("engine_process=True builds the engine in its own process: pass "
                             "a model name or path, not a built LLM")
        self.name = name or (str(model) if self._owns_llm else "model")
        if self._owns_llm and policy == "priority":  # priority is the engine scheduler's
            engine_kwargs.setdefault("scheduling", "priority")
        elif policy == "priority" and model.config.scheduling != "priority":
            raise ValueError("policy='priority' needs an engine that schedules by priority: "
                             "build the LLM with scheduling='priority'")
        self.loop: EngineLoop | EngineProcess
        if engine_process:
            self.llm = None
            self.loop = EngineProcess(resolve_model(model), engine_kwargs, name=self.name,
                                      stall_timeout=stall_timeout, max_restarts=max_restarts)
            self.info = self.loop.info
        else:  # layer 5's LLM: tensor_parallel_size=1 is layer 4's engine itself
            if self._owns_llm:  # a long-lived engine in this process: see engine_worker.py
                bound_cpu_kernel_caches()
            self.llm = l5.LLM(resolve_model(model), **engine_kwargs) if self._owns_llm else model
            self.info = EngineInfo.of(self.llm)
            self.loop = EngineLoop(self.llm, name=self.name, stall_timeout=stall_timeout)
        if chat_stop is None:
            chat_stop = l5.STOP_STRINGS if str(model) == COURSE else ()
        self.chat_stop = tuple(chat_stop)
        self.max_waiting, self.request_timeout = max_waiting, request_timeout
        self.tokenizer = self.info.tokenizer
        self.max_model_len = self.info.max_model_len
        self.created = int(time.time())
        self._ids = itertools.count()

    # ---- facts about the model -----------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def encode(self, prompt: str | Seq[int]) -> list[int]:
        """Text or token ids -> token ids (ValueError: empty, no tokenizer, ids out of range,
        text longer than the context can hold)."""
        if isinstance(prompt, str):
            self.check_chars(len(prompt))
        return l5.encode_prompt(prompt, self.tokenizer, self.info.vocab_size)

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """The longest text that could still fit the context: max_model_len tokens of the
        vocabulary's longest token, twice over (a normalizer may fold characters). Longer
        text is refused before it is tokenized: tokenizing megabytes only to refuse them
        is work a client could make the server do at will."""
        longest = 64  # no vocabulary to read: a generous guess
        vocab = getattr(getattr(self.tokenizer, "tok", None), "get_vocab", None)
        if vocab is not None:
            longest = max((len(t) for t in vocab(with_added_tokens=True)), default=longest)
        return 2 * self.max_model_len * max(1, longest)

    def check_chars(self, num_chars: int) -> None:
        """ValueError when text of num_chars characters cannot fit the context."""
        if num_chars > self.max_prompt_chars:
            raise ValueError(f"the prompt has {num_chars} characters: more than this model's "
                             f"{self.max_model_len}-token context can hold (at most "
                             f"{self.max_prompt_chars} characters)")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The model's own chat template (tokenizer_config.json) -> prompt token ids."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.name!r} has no tokenizer: chat needs one")
        self.check_chars(sum(len(str(m.get("content") or "")) for m in messages))
        return self.tokenizer.encode_chat(messages)

    @property
    def snapshot(self) -> EngineSnapshot:
        """The engine's state after its last turn (written by the engine thread)."""
        return self.loop.snapshot

    @property
    def alive(self) -> bool:
        """The engine's loop (thread or process) is running."""
        return self.loop.alive

    def problem(self) -> str | None:
        """Why this engine does not serve right now (None: it does): down (its process died
        and is being restarted, or restarts failed), or stalled with requests open."""
        reason = self.loop.down_reason
        if reason is not None:
            return reason
        stalled, n = self.loop.stalled_for(), self.loop.open_requests
        if stalled is not None:
            return (f"the engine made no progress for {stalled:.1f} s with "
                    f"{n} request{'' if n == 1 else 's'} open (stalled)")
        return None

    # ---- requests ------------------------------------------------------------------------------
    async def generate(self, prompt: str | Seq[int], params: l5.SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0,
                       timeout: float | None = None, logprobs: int | None = None,
                       presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                       ) -> RequestStream:
        """Queue a request; returns its stream (an async iterator of StreamOutput) once it is
        accepted. ValueError for a bad request, EngineOverloaded when the queue is full.
        logprobs / presence_penalty / frequency_penalty, when given, replace params' own."""
        params = l5.SamplingParams() if params is None else params
        if not isinstance(params, l5.SamplingParams):
            raise TypeError(f"params must be layer 4's SamplingParams, got {type(params).__name__}")
        extras = {"presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty}
        extras = {k: v for k, v in extras.items() if v}
        if logprobs is not None:  # 0: the chosen token's logprob only
            extras["logprobs"] = logprobs
        params = dataclasses.replace(params, **extras) if extras else params  # validates
        ids = self.encode(prompt)
        self._check(ids, params)
        if self.loop.num_queued >= self.max_waiting:
            raise EngineOverloaded(f"model {self.name!r} has {self.loop.num_queued} requests "
                                   f"waiting (limit {self.max_waiting}); retry later",
                                   retry_after=1)
        timeout = self.request_timeout if timeout is None else timeout
        rid = request_id or f"{self.name}-{next(self._ids)}"
        req = Request(rid, ids, params, priority,
                      None if timeout is None else time.perf_counter() + timeout,
                      asyncio.get_running_loop(), asyncio.Queue(), DeltaTracker(self.token_text))
        self.loop.submit(req)
        # the server enforces the timeout too: an engine that stalls cannot hold a client
        deadline = None if timeout is None else time.monotonic() + timeout + TIMEOUT_GRACE_S
        return RequestStream(self, rid, req.queue, len(ids), deadline)

    def _check(self, ids: list[int], params) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"this model's context is {self.max_model_len} tokens; the prompt has "
                             f"{len(ids)} and max_tokens is {params.max_tokens} ({total} in all): "
                             f"shorten the prompt or lower max_tokens")
        info = self.info
        if info.blocks_for(total) > info.num_blocks:
            raise ValueError(f"{total} tokens need {info.blocks_for(total)} KV blocks; the cache "
                             f"holds {info.num_blocks}: lower max_tokens")
        if info.speculative and params.needs_logits_processing:
            raise ValueError("logprobs, presence_penalty and frequency_penalty are not supported "
                             "by this model's speculative decoding: leave them out")
        if params.n > info.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds the server's max_num_seqs "
                             f"{info.max_num_seqs}")

    def abort(self, request_id: str) -> None:
        """Stop a request (its KV blocks are freed before the engine's next step)."""
        self.loop.abort(request_id)

    def shutdown(self) -> None:
        """Stop the engine thread or process (requests still in it get an error) and, for an
        engine this object built, its engine (layer 5's: its tensor-parallel workers)."""
        self.loop.stop()
        if self._owns_llm and self.llm is not None:
            self.llm.close()
