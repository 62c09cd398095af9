"""Lab 4 — system algorithms: your answers.

Four exercises, in the order `lab4.ipynb` teaches them:

1. `BlockAllocator` — the paged KV cache's bookkeeping: a free list, a block table per
   sequence, reference counts, `fork` (share every block) and copy-on-write.
   Write `num_free_blocks`, `append_slots`, `fork` and `free`.
2. `schedule_step` — one step of continuous batching: which sequences run and how many
   tokens each, under a token budget, a sequence cap and the free blocks; chunked prefill;
   preemption of the newest sequence when blocks run out; FCFS admission.
3. `accept_reject` — speculative decoding's accept/reject rule for one sequence: emit what
   the target alone would have sampled, exactly, in distribution.
4. Constrained decoding — `advance`, `token_mask`, `pack_bitmask`, `apply_bitmask`: the token
   mask of a small automaton (the class `Automaton` is given), packed 32 tokens to an int32
   word and applied to a batch of logits, as structured outputs do every step.

Write the code where it says YOUR CODE (each raises NotImplementedError until you do). The
classes `OutOfBlocksError`, `SeqState`, `StepPlan`, `Automaton` and `BlockAllocator.__init__`
are given: keep their names and fields (the grader uses them). Grade yourself with `stack grade --lab 4`.

Rules the grader enforces (see tests/labs/test_lab4.py):
* Plain Python and PyTorch. torch.multinomial, torch.rand, clamp, argmax are all fine.
* Do not import `layer4_algorithms` or `lab4_reference` (the answer key): the grader refuses
  a file that imports them.
* The allocator is checked after every operation of long random runs: ref counts, the free
  count, which blocks each sequence shares, the copies you return, and — by simulating the
  cache's contents through your block tables — that no sequence ever reads another's tokens.
  Every block must be free again once every sequence is (the leak check).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch


def _blocks(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens token slots: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


# ---- Exercise 1: a block allocator with reference counts --------------------------------------
class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than an allocation needs (and nothing was changed)."""


class BlockAllocator:
    """A pool of `num_blocks` KV blocks of `block_size` token slots each, shared by sequences
    through reference counts. Block ids only: the cache's tensors live elsewhere (layer 4's
    `PagedKVCache`), which copies the blocks `append_slots` says to copy.

    block_tables[seq_id]: the sequence's blocks in order; its token at position p lives in
        slot p % block_size of block block_tables[seq_id][p // block_size].
    seq_lens[seq_id]: token slots the sequence has reserved (positions 0 .. seq_len - 1).
    ref_counts[b]: how many block tables hold block b; 0 means free.
    free_list: the free blocks (use it, or keep your own structure: the grader reads only
        block_tables, ref_counts and num_free_blocks).
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
        self.free_list: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds."""
        # YOUR CODE
        raise NotImplementedError("BlockAllocator.num_free_blocks")

    def append_slots(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Reserve slots for seq_id's next num_tokens (>= 1) tokens: positions seq_len ..
        seq_len + num_tokens - 1 (a seq_id not seen before is a new sequence, seq_len 0).

        1. The table must end up with ceil((seq_len + num_tokens) / block_size) blocks: take
           the missing ones from the free list (ref count 1).
        2. Copy-on-write: an *existing* block among those the new positions are written into
           (table indices seq_len // block_size onwards) that another sequence also holds
           (ref count > 1) must not be written: take a fresh block, put it in this table in
           the old one's place (the old block loses a reference), and report (old, new) so
           the cache copies the contents before the write. Blocks before the write range
           stay shared: full blocks never change.
        3. Return the list of (src, dst) copies ([] when nothing is shared).

        If the pool has fewer free blocks than steps 1 + 2 need, raise OutOfBlocksError and
        change nothing at all (check before you take anything).
        """
        # YOUR CODE
        raise NotImplementedError("BlockAllocator.append_slots")

    def fork(self, parent_id: int, child_id: int) -> None:
        """child_id (a new sequence) shares every block of parent_id: one more reference to
        each, the same seq_len (parallel sampling: n completions of one prompt prefilled
        once). KeyError for an unknown parent, ValueError if child_id already exists."""
        # YOUR CODE
        raise NotImplementedError("BlockAllocator.fork")

    def free(self, seq_id: int) -> None:
        """Forget seq_id and drop one reference to each of its blocks; a block that nobody
        holds any more goes back to the free list. KeyError for an unknown or already freed
        seq_id (a double free must not give blocks back twice)."""
        # YOUR CODE
        raise NotImplementedError("BlockAllocator.free")


# ---- Exercise 2: one scheduler step ------------------------------------------------------------
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
    """Plan one step of continuous batching with chunked prefill. Do not change the inputs
    (SeqState is frozen; copy the lists if you reorder them).

    running: oldest first. waiting: in arrival order. num_free_blocks: the pool's free blocks.
    A step computes at most max_num_batched_tokens tokens (the budget) of at most
    max_num_seqs sequences.

    1. Running sequences, oldest first, while budget is left: the sequence takes
       n = min(num_tokens - num_computed, budget) tokens (a decode takes 1, a prefill its next
       chunk), which needs ceil((num_computed + n) / block_size) - ceil(num_computed /
       block_size) new blocks. While fewer are free, preempt the *newest* running sequence not
       yet preempted (the end of the list): its ceil(num_computed / block_size) blocks become
       free. If the newest is the sequence itself, preempt it and stop scheduling running
       sequences. Otherwise schedule (seq_id, n); its blocks and n tokens are used up.
    2. Only if nobody was preempted this step: waiting sequences in order, while budget is
       left and fewer than max_num_seqs sequences run (those still running after step 1 count,
       scheduled or not): the sequence takes n = min(num_tokens, budget) tokens and
       ceil(n / block_size) blocks. The first one whose blocks are not free stops admission:
       FCFS, nobody overtakes it.

    Returns StepPlan(scheduled, preempted). (The engine then moves the preempted to the front
    of the waiting queue to be recomputed from scratch, and the admitted to the end of the
    running list.)
    """
    # YOUR CODE
    raise NotImplementedError("schedule_step")


# ---- Exercise 3: the speculative accept/reject rule ----------------------------------------------
def accept_reject(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                  generator: torch.Generator | None = None) -> list[int]:
    """Verify k drafted tokens of one sequence; return the 1 .. k+1 tokens it emits.

    target_probs: (k+1, V) the target's next-token distributions p_1 .. p_{k+1} (p_j is the
                  target's prediction after the sequence and x_1 .. x_{j-1}: one forward pass
                  over the k+1 tokens gives them all). Rows sum to 1 and may hold zeros.
    draft_probs:  (k, V) the draft's distributions q_1 .. q_k; x_j was drawn from q_j.
    draft_tokens: (k,) int64: x_1 .. x_k. k may be 0.
    generator:    the random stream for every draw (torch.rand / torch.multinomial take
                  generator=...): a seeded generator must give the same tokens every time.

    For j = 1 .. k:
        accept x_j with probability min(1, p_j(x_j) / q_j(x_j))   (draw u ~ U[0, 1): accept
                                                                   when u * q_j(x_j) < p_j(x_j))
        on the first rejection: emit one token drawn from the residual max(0, p_j - q_j),
            normalised to sum 1, and stop (the tokens after x_j are not looked at).
    If all k are accepted: emit a bonus token drawn from p_{k+1}.
    Return the accepted x's followed by that one token, as a list of ints.

    (Should the residual have no mass left — p == q up to rounding — draw from p_j instead.)
    """
    # YOUR CODE
    raise NotImplementedError("accept_reject")


# ---- Exercise 4: constrained decoding, a token mask from an automaton ----------------------------
# Structured outputs (a JSON schema, a regex, a list of choices) work by masking: before each
# token is sampled, the tokens that would leave the allowed language get logit -inf. The engine
# asks a grammar library for the mask (layer4_algorithms/structured/); here the language is a
# small deterministic automaton over characters, given below.
@dataclass
class Automaton:
    """States 0 .. len(next) - 1; next[s]: char -> the state after it (a char missing from it
    is refused in s); `start`; `accepting`: the states where the text may end. Every state can
    still reach an accepting one."""

    next: list[dict[str, int]]
    start: int = 0
    accepting: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def choices(cls, words: list[str]) -> Automaton:
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


def advance(automaton: Automaton, state: int, text: str) -> int | None:
    """The state after reading text's characters one by one from `state` (automaton.next);
    None as soon as a character is refused. advance(a, s, "") is s."""
    # YOUR CODE
    raise NotImplementedError("advance")


def token_mask(automaton: Automaton, state: int, vocab: list[str], eos_id: int) -> torch.Tensor:
    """(V,) bool, V = len(vocab): True for the tokens allowed next in `state`.

    vocab[t] is token t's text (a token may hold several characters). Token t is allowed when
    its text is non-empty and the automaton reads all of it from `state`; the EOS token
    (t == eos_id, whatever its text) is allowed exactly when `state` is accepting.
    """
    # YOUR CODE
    raise NotImplementedError("token_mask")


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """(B, V) bool -> (B, W) int32 with W = ceil(V / 32): bit t % 32 of word t // 32 is set
    when token t is allowed (32 tokens per word: what a grammar library fills and the GPU
    reads, 32x less than a bool per token). Bit 31 is int32's sign bit: a word with it set
    is negative (compute in int64, then wrap values >= 2**31 by subtracting 2**32)."""
    # YOUR CODE
    raise NotImplementedError("pack_bitmask")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A new (B, V) tensor: logits with every token the bitmask (B, W) int32 refuses set to
    -inf (the input is not changed). Unpack with shifts: (word >> bit) & 1."""
    # YOUR CODE
    raise NotImplementedError("apply_bitmask")
