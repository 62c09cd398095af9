"""Lab 4's answer key: what plain `pytest` grades (tests/labs/test_lab4.py's REFERENCE) and
what `lab4.ipynb` runs with LLM_STACK_LAB_REFERENCE=1. A submission that imports it earns
nothing. The engine's algorithms at teaching size, on plain ints and tensors; what each
leaves out, and where the real one is:

* `BlockAllocator` — the paged KV cache's bookkeeping: a free list, per-sequence block tables,
  reference counts, `fork` (share every block) and copy-on-write when a shared block is
  written. The real one is layer 4's `BlockManager` (kv/block_manager.py), which adds prefix
  caching and speculative rollback; with prefix caching off it decides the same.
* `schedule_step` — one iteration of continuous batching: running sequences first (decode 1
  token or the next prefill chunk; preempt the newest when blocks run out), then waiting ones
  in arrival order while the token budget, the sequence cap and the free blocks allow. The
  real one is `Scheduler.schedule` (scheduler.py) with chunked prefill, which also tracks
  sequence objects, parallel-sampling forks, lookahead slots and a static-batching baseline.
* `accept_reject` — speculative decoding's exact rejection sampling for one sequence: it
  calls the engine's own `rejection_sample` (spec/sampling.py), which verifies a whole padded
  batch at once.
* Constrained decoding on a small `Automaton` (`advance`, `token_mask`, `pack_bitmask`,
  `apply_bitmask`): the engine's structured outputs (structured/grammar.py, bitmask.py) ask
  llguidance which tokens a JSON schema allows next, in the same 32-tokens-per-int32-word
  bitmask. `Automaton.choices(["yes", "no"])` accepts exactly those strings,
  `Automaton.digits(n)` 1 to n digits; every state of these automata is live (it can still
  reach an accepting state), so a token the automaton accepts can always be continued.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from layer4_algorithms import rejection_sample


def _blocks(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens token slots: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


# ---- the block allocator -----------------------------------------------------------------
class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than an allocation needs (and nothing was changed)."""


class BlockAllocator:
    """A pool of `num_blocks` KV blocks of `block_size` token slots each, shared by sequences
    through reference counts. Block ids only: the cache's tensors live elsewhere
    (`PagedKVCache`), which copies the blocks `append_slots` says to copy.

    block_tables[seq_id]: the sequence's blocks in order; its token at position p lives in
        slot p % block_size of block block_tables[seq_id][p // block_size].
    seq_lens[seq_id]: token slots the sequence has reserved (positions 0 .. seq_len - 1).
    ref_counts[b]: how many block tables hold block b; 0 means free.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}
        # take from the left, return to the right
        self.free_list: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds."""
        return len(self.free_list)

    def append_slots(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Reserve slots for seq_id's next num_tokens (>= 1) tokens, positions seq_len ..
        seq_len + num_tokens - 1 (a new seq_id starts at 0). Takes new blocks as the table
        grows; a block among those written that another sequence shares (ref count > 1) is
        replaced by a fresh copy first (copy-on-write). Returns the (src, dst) block pairs the
        cache must copy before the writes. OutOfBlocksError, changing nothing, when the pool
        has fewer free blocks than the new blocks plus the copies need."""
        if not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
        table = list(self.block_tables.get(seq_id, []))
        start = self.seq_lens.get(seq_id, 0)
        end, bs = start + num_tokens, self.block_size
        # existing blocks written to
        written = range(start // bs, min(_blocks(end, bs), len(table)))
        shared = [i for i in written if self.ref_counts[table[i]] > 1]
        grow = _blocks(end, bs) - len(table)
        if grow + len(shared) > self.num_free_blocks:
            raise OutOfBlocksError(
                f"sequence {seq_id}: {num_tokens} more tokens need {grow} new block(s) and "
                f"{len(shared)} copy-on-write cop(ies), only {self.num_free_blocks} of "
                f"{self.num_blocks} blocks are free")
        copies = []
        for i in shared:
            old, new = table[i], self._take()
            self.ref_counts[old] -= 1  # still >= 1: the other sharers keep it
            table[i] = new
            copies.append((old, new))
        table += [self._take() for _ in range(grow)]
        self.block_tables[seq_id], self.seq_lens[seq_id] = table, end
        return copies

    def fork(self, parent_id: int, child_id: int) -> None:
        """child_id (new) shares every block of parent_id: one more reference each, the same
        seq_len. KeyError for an unknown parent, ValueError if child_id already exists."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id} already exists")
        table = self.block_tables[parent_id]
        for b in table:
            self.ref_counts[b] += 1
        self.block_tables[child_id], self.seq_lens[child_id] = list(table), self.seq_lens[parent_id]

    def free(self, seq_id: int) -> None:
        """Drop seq_id and one reference to each of its blocks; a block nobody holds any more
        goes back to the free list. KeyError for an unknown (or already freed) seq_id."""
        table = self.block_tables.pop(seq_id)
        del self.seq_lens[seq_id]
        for b in reversed(table):  # tail first, as BlockManager does
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_list.append(b)

    def _take(self) -> int:
        block = self.free_list.popleft()
        self.ref_counts[block] = 1
        return block


# ---- one scheduler step -------------------------------------------------------------------
@dataclass(frozen=True)
class SeqState:
    """The scheduler's view of one sequence.

    num_tokens:   its tokens so far (prompt + generated).
    num_computed: tokens whose k, v are in the cache. A running sequence holds
                  ceil(num_computed / block_size) blocks and still has num_tokens -
                  num_computed >= 1 tokens to compute (1 while decoding); a waiting one holds
                  no blocks and has num_computed == 0.
    """

    seq_id: int
    num_tokens: int
    num_computed: int = 0


@dataclass
class StepPlan:
    """What one step runs. scheduled: (seq_id, num_new_tokens) in the order decided (running
    sequences, then admitted waiting ones); preempted: seq_ids preempted, in that order."""

    scheduled: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)


def schedule_step(running: list[SeqState], waiting: list[SeqState], num_free_blocks: int,
                  block_size: int,
                  max_num_seqs: int, max_num_batched_tokens: int) -> StepPlan:
    """Plan one step of continuous batching with chunked prefill (the inputs are not changed).

    running: oldest first. waiting: in arrival order. num_free_blocks: the pool's free blocks.
    Each step may compute at most max_num_batched_tokens tokens of at most max_num_seqs sequences.

    1. Running sequences, oldest first, while budget is left: one takes n = min(num_tokens -
       num_computed, budget) tokens (a decode 1, a prefill its next chunk), which needs
       ceil((num_computed + n) / bs) - ceil(num_computed / bs) new blocks. While they are not
       free, preempt the *newest* running sequence (the end of the list): its blocks become
       free; if that was the sequence itself, stop scheduling running sequences.
    2. Only if nobody was preempted: waiting sequences in order, while budget is left and fewer
       than max_num_seqs sequences run: n = min(num_tokens, budget) tokens, ceil(n / bs)
       blocks; the first that does not fit stops admission (FCFS: nobody overtakes it).

    The engine then moves preempted sequences to the front of the waiting queue (num_computed
    back to 0: they are recomputed later), admitted ones to the end of the running list.
    """
    for name, v in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                    ("max_num_batched_tokens", max_num_batched_tokens)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    plan, budget, free = StepPlan(), max_num_batched_tokens, num_free_blocks
    queue = list(running)  # preemption pops the newest off the end
    i = 0
    while i < len(queue) and budget > 0:
        seq = queue[i]
        n = min(seq.num_tokens - seq.num_computed, budget)
        need = _blocks(seq.num_computed + n, block_size) - _blocks(seq.num_computed, block_size)
        while need > free and queue[-1] is not seq:
            victim = queue.pop()
            free += _blocks(victim.num_computed, block_size)
            plan.preempted.append(victim.seq_id)
        if need > free:  # only seq itself is left to give up its blocks
            queue.pop()
            plan.preempted.append(seq.seq_id)
            break
        plan.scheduled.append((seq.seq_id, n))
        free, budget, i = free - need, budget - n, i + 1
    if plan.preempted:
        return plan
    seats = len(queue)
    for seq in waiting:
        if budget == 0 or seats >= max_num_seqs:
            break
        n = min(seq.num_tokens, budget)
        need = _blocks(n, block_size)
        if need > free:
            break
        plan.scheduled.append((seq.seq_id, n))
        free, budget, seats = free - need, budget - n, seats + 1
    return plan


# ---- speculative decoding's accept/reject rule -----------------------------------------------
def accept_reject(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                  generator: torch.Generator | None = None) -> list[int]:
    """Verify k drafted tokens of one sequence; returns the 1..k+1 tokens it emits.

    target_probs: (k+1, V) the target's next-token distributions p_1 .. p_{k+1} (p_j after the
                  sequence plus x_1 .. x_{j-1}; rows sum to 1, may hold zeros).
    draft_probs:  (k, V) the draft's distributions q_1 .. q_k that x_1 .. x_k were drawn from.
    draft_tokens: (k,) int64, x_1 .. x_k. generator: the random stream (a seeded one gives
                  the same tokens every time).

    For j = 1..k: accept x_j with probability min(1, p_j(x_j) / q_j(x_j)). At the first
    rejection emit a token drawn from max(0, p_j - q_j) (normalised) and stop; if all k are
    accepted emit a bonus token drawn from p_{k+1}. Every emitted token is then distributed
    exactly as the target alone would draw it. (The layer's batched `rejection_sample`.)
    """
    if target_probs.dim() != 2 or draft_probs.dim() != 2 or draft_tokens.dim() != 1:
        raise ValueError("expected target_probs (k+1, V), draft_probs (k, V), draft_tokens (k,)")
    k, V = draft_probs.shape
    if tuple(target_probs.shape) != (k + 1, V) or draft_tokens.shape[0] != k:
        raise ValueError(f"shapes do not agree: target_probs {tuple(target_probs.shape)}, "
                         "draft_probs "
                         f"{tuple(draft_probs.shape)}, draft_tokens {tuple(draft_tokens.shape)}")
    uniforms = torch.rand(1, k + 1, generator=generator, device=target_probs.device)
    out = rejection_sample(target_probs[None].float(), draft_tokens[None].long(),
                           torch.tensor([k], device=target_probs.device), draft_probs[None].float(),
                           uniforms)
    return out.emitted()[0]


# ---- constrained decoding: a token mask from an automaton ----------------------------------
@dataclass
class Automaton:
    """States 0 .. len(next) - 1; next[s]: char -> the state after it (a char missing from it
    is refused in s); `start`; `accepting`: the states where the text may end."""

    next: list[dict[str, int]]
    start: int = 0
    accepting: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def choices(cls, words: Sequence[str]) -> Automaton:
        """The trie of words: accepts exactly them."""
        nxt: list[dict[str, int]] = [{}]
        accepting = set()
        for w in words:
            s = 0
            for ch in w:
                if ch not in nxt[s]:
                    nxt.append({})
                    nxt[s][ch] = len(nxt) - 1
                s = nxt[s][ch]
            accepting.add(s)
        return cls(nxt, 0, frozenset(accepting))

    @classmethod
    def digits(cls, max_digits: int) -> Automaton:
        """1 to max_digits decimal digits."""
        nxt = [{str(d): i + 1 for d in range(10)} if i < max_digits else {}
               for i in range(max_digits + 1)]
        return cls(nxt, 0, frozenset(range(1, max_digits + 1)))

    def accepts(self, text: str) -> bool:
        s = advance(self, self.start, text)
        return s is not None and s in self.accepting


def advance(automaton: Automaton, state: int, text: str) -> int | None:
    """The state after reading text's characters from state; None if one is refused."""
    for ch in text:
        state = automaton.next[state].get(ch)
        if state is None:
            return None
    return state


def token_mask(automaton: Automaton, state: int, vocab: Sequence[str], eos_id: int
               ) -> torch.Tensor:
    """(V,) bool: token t is allowed in `state` when vocab[t] is non-empty and the automaton
    reads all of it; eos_id is allowed exactly when `state` is accepting."""
    allowed = torch.zeros(len(vocab), dtype=torch.bool)
    for t, text in enumerate(vocab):
        if t == eos_id:
            allowed[t] = state in automaton.accepting
        elif text and advance(automaton, state, text) is not None:
            allowed[t] = True
    return allowed


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """(B, V) bool -> (B, W) int32, W = ceil(V / 32): bit t % 32 of word t // 32 set when
    token t is allowed (bit 31 is the int32's sign bit: the word is negative then)."""
    B, V = allowed.shape
    W = (V + 31) // 32
    padded = torch.zeros(B, W * 32, dtype=torch.int64)
    padded[:, :V] = allowed.to(torch.int64)
    words = (padded.view(B, W, 32) << torch.arange(32, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of logits (B, V) with the tokens bitmask (B, W) int32 refuses set to -inf."""
    V = logits.shape[-1]
    bits = (bitmask.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1  # (B, W, 32)
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :V].bool()
    return logits.masked_fill(~allowed, float("-inf"))
