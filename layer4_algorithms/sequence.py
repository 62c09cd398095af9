"""One sequence's state as the engine runs it: tokens, KV bookkeeping, text, timings.

A request with SamplingParams.n == 1 is one Sequence; with n > 1 it starts as one (the
prompt is prefilled once) and forks into n sequences when the first tokens are sampled,
the children sharing the prompt's KV blocks (copy-on-write; see kv/block_manager.py).

The KV invariant every module relies on:

    token_ids = prompt_ids + output_ids              (the sequence so far)
    num_computed_tokens                              tokens whose k, v are in the cache

A step computes the next tokens token_ids[num_computed : num_computed + q]. While a prompt
is being prefilled (in chunks) num_computed < num_prompt_tokens; once it is running a
decode, num_computed == len(token_ids) - 1: the newest sampled token is the next input.
Preemption by recomputation sets num_computed back to 0 and keeps the tokens.

Under async scheduling (engine.py) a step is scheduled before the previous one's tokens
reach the host: num_pending counts sampled tokens still on the device (they count in
num_tokens, not in token_ids), and num_computed_tokens is advanced when a step is
scheduled, so the next schedule sees where the sequence will be once the GPU catches up.
"""
from __future__ import annotations

import enum
import time

import numpy as np
import torch

import layer3_model as l3


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue: no KV blocks
    RUNNING = "running"  # holds KV blocks, scheduled every step it fits the budget
    FINISHED = "finished"


class Sequence:
    """prompt_ids / output_ids / token_ids (lists of ints); block_table: KV block ids, block i
    holds positions [i * block_size, (i + 1) * block_size); block_hashes: prefix-cache hashes
    of its full, computed blocks; row: a small slot id (0..max_num_seqs-1) while running, for
    per-slot state outside the cache (a draft model's KV row). Finishing (EOS, stop strings,
    max_tokens) and the text follow layer 3's FinishRule (`finish`); `safe_text` is the part
    of it the rule has released (no possible stop-string start, no half character).
    priority: lower runs sooner under the "priority" policy. logprobs: one TokenLogprobs per
    output token when params.logprobs is set (else None). spec_proposed / spec_accepted:
    this sequence's draft tokens verified and accepted (speculative decoding). prompt_array:
    prompt_ids as an int64 numpy array (read only; the runner slices a prefill's input ids
    from it), or None."""

    def __init__(self, seq_id: int, request_id: str, prompt_ids: list[int],
                 params: l3.SamplingParams, *, index: int = 0,
                 generator: torch.Generator | None = None,
                 decoder: l3.IncrementalDecoder | None = None,
                 eos_token_ids: tuple[int, ...] = (), arrival_time: float | None = None,
                 priority: int = 0, prompt_array: np.ndarray | None = None) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.prompt_ids = list(prompt_ids)
        self.token_ids = list(prompt_ids)
        self.prompt_array = prompt_array
        self.params = params
        self.generator = generator
        self.decoder = decoder
        self.eos_token_ids = eos_token_ids
        self.finish = l3.FinishRule(params, eos_token_ids, decoder)
        self.output_ids: list[int] = self.finish.token_ids  # the rule appends to it
        # the length at which max_tokens stops it (token_ids is prompt_ids + output_ids)
        self.max_num_tokens = len(self.prompt_ids) + params.max_tokens
        self.priority = priority
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.spec_proposed = 0
        self.spec_accepted = 0
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.num_preemptions = 0
        self.row: int | None = None
        self.num_pending = 0  # sampled tokens not yet on the host (async scheduling)
        # delta outputs (LLM.step(delta=True)): output tokens and text characters handed out
        self.delta_tokens = self.delta_chars = 0
        self.delta_started = False  # a delta output of its request went out (the prompt with it)
        self.pending_index = -1  # the newest one's row in its step's token tensor
        self.pending_forks = params.n - 1 if index == 0 else 0
        self.grammar = None  # a GrammarState (structured/) when the output is constrained
        self.finish_reason: str | None = None  # "eos" | "stop" | "length" | "abort" | "error"
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.value}, tokens={len(self.token_ids)}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")

    @property
    def text(self) -> str:
        """The output's text so far (cut before a stop string)."""
        return self.finish.text

    @property
    def safe_text(self) -> str:
        """The text the FinishRule has released so far (all of `text` once finished): what a
        stream may show, as no later token can take it back."""
        return self.finish.text[:self.finish.emitted]

    @property
    def num_tokens(self) -> int:
        """Tokens so far, those still on the device (num_pending) included."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to feed through the model before the next one can be sampled."""
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens

    def append_token(self, token: int, now: float | None = None) -> bool:
        """Add one sampled token; True when the sequence is finished by it (EOS unless
        ignore_eos, a stop string, max_tokens: layer 3's FinishRule, as its generate does;
        EOS is not added to the output, a stop string is cut from the text)."""
        if now is None:
            now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.finish_reason = reason = self.finish.add(token)
        if reason != "eos":  # the rule took the token into output_ids (EOS it leaves out)
            self.token_ids.append(token)
            if self.grammar is not None:  # once per output position (accept_at)
                self.grammar.accept_at(token, len(self.output_ids) - 1)
        return reason is not None

    def fork(self, seq_id: int, index: int, generator: torch.Generator | None,
             decoder: l3.IncrementalDecoder | None) -> Sequence:
        """A sibling that shares everything computed so far (the caller shares the KV blocks
        through the block manager). Only before the first output token (parallel sampling)."""
        if self.output_ids:
            raise RuntimeError("fork happens before the first output token (parallel sampling)")
        child = Sequence(seq_id, self.request_id, self.prompt_ids, self.params, index=index,
                         generator=generator, decoder=decoder, eos_token_ids=self.eos_token_ids,
                         arrival_time=self.arrival_time, priority=self.priority,
                         prompt_array=self.prompt_array)
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.block_hashes = list(self.block_hashes)
        child.first_scheduled_time = self.first_scheduled_time
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        return child
