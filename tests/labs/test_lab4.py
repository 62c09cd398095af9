"""Lab 4 grader: a block allocator with reference counts, one scheduler step and the speculative
accept/reject rule and a token mask from a small automaton, each against the lab's answer key
(labs/lab4_algorithms/lab4_reference.py) on fresh random inputs.

Graded through the `impl` fixture (tests/labs/conftest.py): a student's exercises.py under
`stack grade --lab 4`; under plain pytest the answer key (which decides exactly what the
engine's BlockManager, Scheduler and rejection_sample decide).
Seeds are drawn afresh every run and printed in every failure message.

* The allocator runs long random sequences of append / fork / free (and allocations that do
  not fit) beside the reference. After every operation: ref counts equal the number of tables
  holding each block, the free count matches, the sharing pattern and the copy-on-write
  copies are the reference's (block ids may differ: only the structure is compared), and a
  simulated cache, written through the submission's tables and copies, reads back every
  sequence's own tokens. When every sequence is freed, every block must be free (leak check).
* The scheduler step is deterministic: its plan must equal the reference's, in hand-made
  situations (budget, FCFS, chunked prefill, the sequence cap, preemption) and at every step
  of random workloads driven to completion.
* The accept/reject rule: exact under a greedy target; otherwise chi-square tests (p-value
  above 1e-6, computed with torch.special.gammaincc) that the emitted tokens follow the
  target's distributions whatever the draft's, and that acceptance happens as often as
  min(p, q) says.
* The token mask: advance / token_mask equal the reference's on random automata (tries of
  random words, digit runs) and vocabularies; the packed bitmask equals it word for word
  (widths that are and are not multiples of 32, bit 31 set); applying it leaves the input
  alone; and the four together decode a batch of random logits into words of the language.
"""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from .references import import_reference

REFERENCE = "lab4_reference"
ref = import_reference(REFERENCE)

seeds = random.SystemRandom()  # fresh inputs every run: an answer must be right for any input
ALPHA = 1e-6  # a correct answer fails a statistical check once in a million runs
# The per-test limit (`stack grade --timeout`, 30 s) catches hangs; the sampling tests draw
# many tokens (3 s idle, several times that on a loaded 2-core machine), so they get this one.
HEAVY_TIMEOUT_S = 120


def _blocks(n: int, bs: int) -> int:
    return -(-n // bs)


# ================================================================ exercise 1: the allocator
class Harness:
    """Drives a submission's BlockAllocator beside the reference's and checks both after every
    operation. `tokens[s]` is what sequence s must read back; `data[b][i]` is what the
    simulated cache holds in slot i of the submission's block b."""

    def __init__(self, impl: ModuleType, num_blocks: int, block_size: int, what: str) -> None:
        self.impl, self.what = impl, what
        self.mine = impl.BlockAllocator(num_blocks, block_size)
        self.theirs = ref.BlockAllocator(num_blocks, block_size)
        self.nb, self.bs = num_blocks, block_size
        self.tokens: dict[int, list[int]] = {}
        self.data: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.label = 0
        self.log: list[str] = []

    def fail(self, message: str) -> None:
        recent = "; ".join(self.log[-6:])
        pytest.fail(f"{self.what}: {message}\n  (block_size={self.bs}, num_blocks={self.nb}; last "
                    f"operations: {recent})", pytrace=False)

    # ---- operations ---------------------------------------------------------------------
    def append(self, seq: int, n: int) -> list[tuple[int, int]] | None:
        """append_slots on both: the submission's copies, or None when the reference ran out of
        blocks (and so did the submission, which must then have changed nothing)."""
        self.log.append(f"append_slots({seq}, {n})")
        before = self.snapshot()
        try:
            want = self.theirs.append_slots(seq, n)
        except ref.OutOfBlocksError:
            want = None
        try:
            got = self.mine.append_slots(seq, n)
        except self.impl.OutOfBlocksError:
            got = None
        if want is None:
            if got is not None:
                self.fail(f"append_slots({seq}, {n}) needs more blocks than the {self.theirs.num_free_blocks} "
                          f"free: it must raise OutOfBlocksError, it returned {got!r}")
            if self.snapshot() != before:
                self.fail(f"append_slots({seq}, {n}) raised OutOfBlocksError but changed the allocator "
                          f"(tables, ref counts or free count): a failed allocation must change nothing")
            self.log[-1] += " -> OutOfBlocksError"
            return None
        if got is None:
            self.fail(f"append_slots({seq}, {n}) raised OutOfBlocksError, but enough blocks were free")
        if not isinstance(got, (list, tuple)) or not all(isinstance(c, (list, tuple)) and len(c) == 2 for c in got):
            self.fail(f"append_slots must return a list of (src, dst) pairs, got {got!r}")
        got = [(int(a), int(b)) for a, b in got]
        for src, dst in got:  # the cache copies blocks before the step writes
            if not (0 <= src < self.nb and 0 <= dst < self.nb):
                self.fail(f"copy {(src, dst)}: block ids must be in 0..{self.nb - 1}")
            self.data[dst] = list(self.data[src])
        table = self._table(self.mine, seq)
        old = len(self.tokens.get(seq, []))
        self.tokens.setdefault(seq, [])
        for pos in range(old, old + n):  # write the new tokens through the submission's table
            if pos // self.bs >= len(table):
                self.fail(f"after append_slots({seq}, {n}) sequence {seq} has {len(table)} blocks: too few "
                          f"for {old + n} tokens of block_size {self.bs}")
            self.label += 1
            self.data[table[pos // self.bs]][pos % self.bs] = self.label
            self.tokens[seq].append(self.label)
        self.check(copies=(got, want))
        return got

    def fork(self, parent: int, child: int) -> None:
        self.log.append(f"fork({parent}, {child})")
        self.theirs.fork(parent, child)
        self.mine.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.check()

    def free(self, seq: int) -> None:
        self.log.append(f"free({seq})")
        self.theirs.free(seq)
        self.mine.free(seq)
        del self.tokens[seq]
        self.check()

    # ---- checks ---------------------------------------------------------------------------
    def snapshot(self) -> tuple:
        tables = {int(s): [int(b) for b in t] for s, t in self.mine.block_tables.items()}
        return tables, [int(r) for r in self.mine.ref_counts], self.mine.num_free_blocks

    def _table(self, alloc, seq: int) -> list[int]:
        tables = alloc.block_tables
        if seq not in tables:
            self.fail(f"sequence {seq} is missing from block_tables")
        return [int(b) for b in tables[seq]]

    def check(self, copies: tuple | None = None) -> None:
        mine = self.mine
        live = set(self.tokens)
        if set(mine.block_tables) != live:
            self.fail(f"block_tables holds sequences {sorted(mine.block_tables)}, expected {sorted(live)}")
        refs = [0] * self.nb
        for s in live:
            table = self._table(mine, s)
            if len(table) != _blocks(len(self.tokens[s]), self.bs):
                self.fail(f"sequence {s} has {len(table)} blocks for {len(self.tokens[s])} tokens of block_size "
                          f"{self.bs}: expected exactly {_blocks(len(self.tokens[s]), self.bs)}")
            if len(set(table)) != len(table) or not all(0 <= b < self.nb for b in table):
                self.fail(f"sequence {s}'s block table {table} repeats a block or holds an id outside 0..{self.nb - 1}")
            for b in table:
                refs[b] += 1
        got_refs = [int(r) for r in mine.ref_counts]
        if got_refs != refs:
            bad = [b for b in range(self.nb) if got_refs[b] != refs[b]][:5]
            self.fail("ref_counts must count the tables holding each block: " + ", ".join(
                f"block {b} is in {refs[b]} table(s), ref count {got_refs[b]}" for b in bad))
        free = sum(1 for r in refs if r == 0)
        if mine.num_free_blocks != free:
            self.fail(f"num_free_blocks is {mine.num_free_blocks} but {free} blocks are held by nobody "
                      f"(a leak, or a block handed out twice)")
        for s in live:  # every sequence reads back its own tokens through its table
            table = self._table(mine, s)
            got = [self.data[table[p // self.bs]][p % self.bs] for p in range(len(self.tokens[s]))]
            if got != self.tokens[s]:
                p = next(i for i, (a, b) in enumerate(zip(got, self.tokens[s], strict=True)) if a != b)
                self.fail(f"sequence {s} reads back another sequence's token at position {p} (block "
                          f"{table[p // self.bs]}): a block shared after fork was written without "
                          f"copy-on-write, a copy was not reported, or a block still in use was reused")
        self._same_structure(copies)

    def _same_structure(self, copies: tuple | None) -> None:
        """The submission's tables are the reference's up to renaming the blocks."""
        to_ref: dict[int, int] = {}
        for s in self.tokens:
            for b, rb in zip(self._table(self.mine, s), self._table(self.theirs, s), strict=True):
                if to_ref.setdefault(b, rb) != rb:
                    self.fail(f"block {b} is shared where the reference does not share (sequence {s}): "
                              f"copy-on-write copies only shared blocks that are written")
        if len(set(to_ref.values())) != len(to_ref):
            self.fail("two sequences hold separate blocks where they should share one: fork shares every "
                      "block, and only written blocks are copied")
        if self.mine.num_free_blocks != self.theirs.num_free_blocks:
            self.fail(f"{self.mine.num_free_blocks} free blocks, expected {self.theirs.num_free_blocks}")
        if copies is not None:
            got, want = copies
            mapped = sorted((to_ref.get(a, -1), to_ref.get(b, -1)) for a, b in got)
            if mapped != sorted(want):
                self.fail(f"append_slots returned copies {got}; expected {len(want)} copy(ies) of the written, "
                          f"shared blocks into fresh ones (src = the shared block, dst = this sequence's new one)")

    def free_everything_and_check_no_leak(self) -> None:
        for s in list(self.tokens):
            self.free(s)
        refs = [int(r) for r in self.mine.ref_counts]
        if any(refs) or self.mine.num_free_blocks != self.nb:
            self.fail(f"leak: every sequence was freed but {self.nb - self.mine.num_free_blocks} block(s) are "
                      f"not free, ref counts {refs}")


def _random_ops(h: Harness, rng: random.Random, n_ops: int) -> None:
    next_id = 0
    for _ in range(n_ops):
        live = list(h.tokens)
        r = rng.random()
        if r < 0.45 or not live:
            if live and rng.random() < 0.65:
                seq = rng.choice(live)
            else:
                seq, next_id = next_id, next_id + 1
            h.append(seq, rng.choice([1, 1, 1, rng.randint(1, h.bs), rng.randint(1, 3 * h.bs + 2)]))
        elif r < 0.7:
            h.fork(rng.choice(live), next_id)
            next_id += 1
        else:
            h.free(rng.choice(live))


@pytest.mark.points(8)
def test_allocator_grows_block_by_block(impl, seeded):
    seed, rng = seeded
    for bs in (1, rng.choice([3, 5, 7]), 16):
        nb = rng.randint(25, 60)
        h = Harness(impl, nb, bs, f"allocate and free, no sharing [seed {seed}]")
        if h.mine.num_free_blocks != nb:
            h.fail(f"a new allocator has {h.mine.num_free_blocks} free blocks, expected {nb}")
        for _ in range(12):  # four sequences growing in turns: their blocks interleave in the pool
            seq = rng.randrange(4)
            copies = h.append(seq, rng.choice([1, rng.randint(1, 2 * bs + 1)]))
            if copies:
                h.fail(f"append_slots on a sequence nobody shares returned copies {copies}")
        h.free(rng.choice(list(h.tokens)))
        h.append(99, rng.randint(1, 3 * bs))  # reuses what was freed
        h.free_everything_and_check_no_leak()


@pytest.mark.points(10)
def test_allocator_fork_and_copy_on_write(impl, seeded):
    seed, rng = seeded
    for bs in (rng.choice([2, 3, 4, 5]), 16):
        for prompt in (bs * rng.randint(1, 4), bs * rng.randint(1, 4) + rng.randint(1, bs - 1)):
            n = rng.randint(2, 5)  # parallel sampling: n completions share the prompt's blocks
            h = Harness(impl, 4 * n + prompt // bs + 2, bs, f"fork + copy-on-write, prompt {prompt}, n={n} "
                        f"[seed {seed}]")
            h.append(0, prompt)
            for child in range(1, n):
                h.fork(0, child)
            for b in h.mine.block_tables[0]:
                if h.mine.ref_counts[b] != n:
                    h.fail(f"after {n - 1} forks every prompt block must have ref count {n}, block {b} has "
                           f"{h.mine.ref_counts[b]}")
            partial = prompt % bs != 0
            order = list(range(n))
            rng.shuffle(order)
            for i, seq in enumerate(order):  # each completion writes its first token
                h.append(seq, 1)
                got = h.mine.block_tables[seq]
                if partial and i < n - 1 and h.mine.ref_counts[got[-1]] != 1:
                    h.fail(f"sequence {seq} wrote into its last block, shared by {n - i} sequences, without "
                           f"taking a copy")
            for seq in order:  # decode a little further: full blocks stay shared
                h.append(seq, rng.randint(1, 2 * bs))
            shared = h.mine.block_tables[0][: prompt // bs]
            if any(h.mine.ref_counts[b] != n for b in shared):
                h.fail("the prompt's full blocks must stay shared by all completions (ref count n): only "
                       "written blocks are copied")
            h.free_everything_and_check_no_leak()


def _random_runs(impl: ModuleType, what: str, runs: int, block_sizes: list[int],
                 num_blocks: tuple[int, int], num_ops: tuple[int, int]) -> Iterator[Harness]:
    """`runs` allocators (block size and pool size drawn), each driven through random
    operations beside the reference and then freed whole (the leak check); yields each."""
    seed = seeds.randrange(2**31)
    rng = random.Random(seed)
    for trial in range(runs):
        bs, nb = rng.choice(block_sizes), rng.randint(*num_blocks)
        h = Harness(impl, nb, bs, f"{what}, run {trial} [seed {seed}]")
        _random_ops(h, rng, rng.randint(*num_ops))
        h.free_everything_and_check_no_leak()
        yield h


@pytest.mark.points(12)
def test_allocator_random_operations(impl):
    for _ in _random_runs(impl, "random operations", 12, [1, 2, 3, 4, 5, 8, 16], (3, 40),
                          (30, 120)):
        pass  # every check ran inside


@pytest.mark.points(5)
def test_allocator_leaks_nothing(impl):
    for h in _random_runs(impl, "leak check", 6, [1, 3, 16], (5, 33), (20, 80)):
        nb, bs = h.nb, h.bs
        h.log.append(f"append_slots(1000, {nb * bs}) after freeing everything")
        if h.append(1000, nb * bs) is None:  # the whole pool is usable again
            h.fail("after freeing everything, one sequence cannot take the whole pool")
        if h.append(1001, 1) is not None:
            h.fail("a full pool handed out another block")
        h.free(1000)
        try:  # a double free must not give blocks back twice
            h.mine.free(1000)
        except KeyError:
            pass
        else:
            h.fail("free() of a sequence already freed must raise KeyError")
        if h.mine.num_free_blocks != nb or any(h.mine.ref_counts):
            h.fail("a double free changed the free count or the ref counts")


@pytest.mark.points(5)
def test_allocator_out_of_blocks(impl, seeded):
    seed, rng = seeded
    assert issubclass(impl.OutOfBlocksError, RuntimeError), "OutOfBlocksError must stay a RuntimeError"
    bs = rng.choice([2, 3, 4, 7])
    nb = rng.randint(4, 12)
    h = Harness(impl, nb, bs, f"out of blocks [seed {seed}]")
    h.append(0, (nb - 2) * bs + 1)  # leaves 1 block free, the last block partly filled
    if h.append(1, 2 * bs) is not None:  # needs 2
        h.fail("allocated more blocks than are free")
    if 1 in h.mine.block_tables:
        h.fail("a new sequence whose allocation failed must not be registered")
    h.fork(0, 1)
    h.append(1, 1)  # copy-on-write of the shared last block takes the last free block
    if h.mine.num_free_blocks != 0:
        h.fail("copy-on-write of the shared last block must take the one free block")
    h.fork(0, 2)
    if h.append(2, 1) is not None:  # would need a copy, and nothing is free: refuse, never write into a shared block
        h.fail("wrote into a shared block with no free block for its copy: must raise OutOfBlocksError")
    h.free(1)
    if h.append(2, 1) is None:  # now it fits
        h.fail("after a free, the same allocation must succeed")
    h.free_everything_and_check_no_leak()


# ================================================================ exercise 2: the scheduler step
def _states(module: ModuleType, rows: list[tuple[int, int, int]]) -> list:
    return [module.SeqState(i, n, c) for i, n, c in rows]


def _plan(module: ModuleType, running, waiting, free, bs, max_seqs, budget) -> tuple[list, list]:
    r, w = _states(module, running), _states(module, waiting)
    r0, w0 = list(r), list(w)
    out = module.schedule_step(r, w, free, bs, max_seqs, budget)
    assert r == r0 and w == w0, "schedule_step must not change its input lists"
    scheduled = [(int(s), int(n)) for s, n in out.scheduled]
    return scheduled, [int(s) for s in out.preempted]


def _check_step(impl, running, waiting, free, bs, max_seqs, budget, what: str) -> tuple[list, list]:
    want = _plan(ref, running, waiting, free, bs, max_seqs, budget)
    got = _plan(impl, running, waiting, free, bs, max_seqs, budget)
    if got != want:
        pytest.fail(
            f"{what}\n  running (seq_id, num_tokens, num_computed): {running}\n  waiting: {waiting}\n"
            f"  num_free_blocks={free}, block_size={bs}, max_num_seqs={max_seqs}, max_num_batched_tokens={budget}\n"
            f"  expected scheduled={want[0]} preempted={want[1]}\n  got      scheduled={got[0]} "
            f"preempted={got[1]}", pytrace=False)
    return got


@pytest.mark.points(10)
def test_schedule_step_budget_fcfs_and_chunked_prefill(impl, seeded):
    seed, rng = seeded
    bs = rng.choice([1, 3, 4, 16])
    decodes = [(i, c + 1, c) for i, c in enumerate(rng.randint(1, 90) for _ in range(rng.randint(1, 5)))]
    prompts = [(100 + i, rng.randint(1, 60), 0) for i in range(rng.randint(3, 6))]
    tag = f"[seed {seed}]"
    # decodes take one token each, then prompts are admitted in order; the last may be chunked
    budget = len(decodes) + sum(n for _, n, _ in prompts[:2]) + rng.randint(1, max(1, prompts[2][1] - 1))
    _check_step(impl, decodes, prompts, 1000, bs, 64, budget,
                f"decodes first, then waiting prompts in order, the last one chunked to the budget {tag}")
    # the budget runs out inside the running list: later running sequences wait, nobody is admitted
    _check_step(impl, decodes + [(50, 40, 0 + bs)], prompts, 1000, bs, 64, len(decodes) + rng.randint(1, 20),
                f"a running prefill takes its next chunk; then the budget is spent {tag}")
    if len(decodes) > 1:
        _check_step(impl, decodes, prompts, 1000, bs, 64, len(decodes) - 1, f"budget below the decodes {tag}")
    # max_num_seqs caps how many run
    _check_step(impl, decodes, prompts, 1000, bs, len(decodes) + 1, 10_000, f"max_num_seqs {tag}")
    # FCFS: the first waiting prompt does not fit the free blocks, so the small one behind it waits too
    big, small = (200, 10 * bs + 1, 0), (201, 1, 0)
    free = rng.randint(1, 10)
    _check_step(impl, decodes, [big, small], free + sum(1 for _, n, c in decodes if c % bs == 0), bs, 64, 10_000,
                f"FCFS: a waiting prompt that does not fit blocks the ones behind it {tag}")
    # admission is limited by free blocks: a chunk needs ceil(n / block_size) blocks
    _check_step(impl, [], prompts, rng.randint(0, 8), bs, 64, rng.randint(1, 200), f"admission by free blocks {tag}")
    for trial in range(40):  # and anything else
        running = [(i, c + rng.choice([1, 1, rng.randint(1, 40)]), c) for i, c in
                   enumerate(rng.randint(0, 60) for _ in range(rng.randint(0, 6)))]
        running = [(i, n, c) for i, n, c in running if n > c]
        waiting = [(100 + i, rng.randint(1, 70), 0) for i in range(rng.randint(0, 6))]
        _check_step(impl, running, waiting, rng.randint(0, 40), rng.choice([1, 2, 5, 16]), rng.randint(1, 9),
                    rng.randint(1, 120), f"random situation {trial} {tag}")


@pytest.mark.points(8)
def test_schedule_step_preemption(impl, seeded):
    seed, rng = seeded
    tag = f"[seed {seed}]"
    bs = rng.choice([2, 4, 8, 16])
    # every decode sits at a block boundary (needs a new block) and no block is free:
    # the newest running sequences are preempted until the older ones fit
    running = [(i, bs * rng.randint(1, 5) + 1, 0) for i in range(rng.randint(3, 7))]
    running = [(i, n, n - 1) for i, n, _ in running]
    got = _check_step(impl, running, [(100, 5, 0)], 0, bs, 64, 1000,
                      f"no free blocks, decodes at block boundaries: preempt the newest {tag}")
    assert got[1], f"nothing was preempted although no block was free {tag}"
    # one sequence alone, no free block: it preempts itself
    _check_step(impl, running[:1], [(100, 5, 0)], 0, bs, 64, 1000, f"the only running sequence preempts itself {tag}")
    # a long prefill chunk needs several blocks: preempted sequences give back all theirs
    long = (0, 12 * bs, 0 + bs)
    others = [(i, bs * rng.randint(1, 3) + 2, bs * rng.randint(1, 3) + 1) for i in range(1, 5)]
    others = [(i, c + 1, c) for i, _, c in others]
    _check_step(impl, [long] + others, [], rng.randint(0, 3), bs, 64, 1000,
                f"a chunk that needs several blocks preempts until it fits {tag}")
    for trial in range(40):
        running = []
        for i in range(rng.randint(1, 7)):
            c = rng.randint(1, 6) * bs + rng.choice([0, 0, rng.randint(1, bs)])
            running.append((i, c + rng.choice([1, 1, rng.randint(1, 3 * bs)]), c))
        _check_step(impl, running, [(100, rng.randint(1, 30), 0)], rng.randint(0, 3), bs, rng.randint(1, 9),
                    rng.randint(1, 60), f"random situation with few free blocks {trial} {tag}")


def _simulate(impl, rng: random.Random, what: str) -> int:
    """Drive a random workload to completion with the submission's plans, checking each against
    the reference's. Returns the number of preemptions seen."""
    bs, nb = rng.choice([1, 2, 3, 5, 8, 16]), rng.randint(3, 40)
    max_seqs, budget = rng.randint(1, 8), rng.randint(1, 64)
    state: dict[int, list[int]] = {}  # seq_id -> [num_tokens, num_computed, generated, max_new]
    arrivals = []
    for i in range(rng.randint(2, 12)):
        n = rng.randint(1, 40)
        max_new = rng.randint(1, 30)
        if n + max_new > nb * bs:  # could never fit the pool: the engine refuses it at add()
            continue
        arrivals.append((rng.randint(0, 20), i, n, max_new))
    running: list[int] = []
    waiting: deque[int] = deque()
    preemptions = 0
    for step in range(5000):
        for t, i, n, max_new in arrivals:
            if t == step:
                state[i] = [n, 0, 0, max_new]
                waiting.append(i)
        if not running and not waiting and step > 20:
            return preemptions
        used = sum(_blocks(state[s][1], bs) for s in running)
        rows = [(s, state[s][0], state[s][1]) for s in running]
        wrows = [(s, state[s][0], state[s][1]) for s in waiting]
        scheduled, preempted = _check_step(impl, rows, wrows, nb - used, bs, max_seqs, budget,
                                           f"{what}, step {step}")
        preemptions += len(preempted)
        for s in preempted:
            running.remove(s)
            state[s][1] = 0
            waiting.appendleft(s)
        for s, n in scheduled:
            if s in waiting:
                waiting.remove(s)
                running.append(s)
            st = state[s]
            st[1] += n
            if st[1] == st[0]:  # reached the end: a token is sampled
                st[0] += 1
                st[2] += 1
                if st[2] == st[3]:
                    running.remove(s)
    pytest.fail(f"{what}: not finished after 5000 steps", pytrace=False)


@pytest.mark.points(12)
def test_schedule_step_random_workloads(impl, seeded):
    seed, rng = seeded
    for run in range(25):
        _simulate(impl, rng, f"random workload {run} [seed {seed}]")


# ================================================================ exercise 3: accept / reject
def _emit(impl, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, gen: torch.Generator, what: str) -> list[int]:
    out = impl.accept_reject(p, q, x, gen)
    if not isinstance(out, (list, tuple)):
        pytest.fail(f"{what}: accept_reject must return a list of ints, got {type(out).__name__}", pytrace=False)
    out = [int(t) for t in out]
    k = x.shape[0]
    if not 1 <= len(out) <= k + 1:
        pytest.fail(f"{what}: emitted {len(out)} tokens; a round emits 1 to k+1 = {k + 1}", pytrace=False)
    if out[:-1] != x[: len(out) - 1].tolist():
        pytest.fail(f"{what}: emitted {out} for drafts {x.tolist()}: all but the last emitted token must be "
                    f"the accepted drafts, in order", pytrace=False)
    last = out[-1]
    if not 0 <= last < p.shape[1] or p[len(out) - 1, last] <= 0:
        pytest.fail(f"{what}: emitted token {last} at position {len(out)}, which the target gives probability 0",
                    pytrace=False)
    return out


def _p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against probs (cells with an expected count below 5
    pooled): the probability of a statistic this large if the counts follow probs."""
    counts, probs = counts.double(), probs.double() / probs.sum()
    expected = probs * counts.sum()
    if (counts[expected == 0] > 0).any():
        return 0.0
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    dof = int(keep.sum()) - 1
    if dof < 1:
        return 1.0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def _assert_follows(samples: list[int], probs: torch.Tensor, what: str) -> None:
    counts = torch.bincount(torch.tensor(samples, dtype=torch.int64), minlength=probs.numel())
    pv = _p_value(counts, probs)
    if pv < ALPHA:
        freq = counts.double() / max(len(samples), 1)
        pytest.fail(f"{what}: over {len(samples)} rounds the frequencies {freq.numpy().round(3).tolist()} do not "
                    f"follow {probs.double().numpy().round(3).tolist()} (chi-square p-value {pv:.2g})",
                    pytrace=False)


def _random_dist(gen: torch.Generator, rows: int, V: int, sharp: float, zeros: int) -> torch.Tensor:
    logits = sharp * torch.randn(rows, V, generator=gen)
    for r in range(rows):  # a few tokens this model never picks
        logits[r, torch.randperm(V, generator=gen)[:zeros]] = float("-inf")
    return torch.softmax(logits, dim=-1)


def _draw(q: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.multinomial(q, 1, generator=gen)[:, 0]


def _run_rounds(impl, p, q, n, seed, what) -> list[list[int]]:
    student = torch.Generator().manual_seed(seed)
    drafts = torch.Generator().manual_seed(seed + 1)
    return [_emit(impl, p, q, _draw(q, drafts), student, what) for _ in range(n)]


@pytest.mark.points(8)
def test_accept_reject_greedy_is_exact(impl):
    seed = seeds.randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(60):
        k, V = rng.randint(0, 6), rng.randint(2, 50)
        best = torch.randint(0, V, (k + 1,), generator=gen)
        p = torch.zeros(k + 1, V).scatter_(1, best[:, None], 1.0)  # temperature 0: one-hot at the argmax
        x = torch.where(torch.rand(k, generator=gen) < 0.7, best[:k], torch.randint(0, V, (k,), generator=gen))
        if rng.random() < 0.5:  # a greedy draft (or an n-gram guess): q one-hot at its guess
            q = torch.zeros(k, V).scatter_(1, x[:, None], 1.0)
        else:  # a sampled draft: x has some probability under q
            q = _random_dist(gen, k, V, 2.0, 0)
            q = (q + torch.zeros(k, V).scatter_(1, x[:, None], 0.3)) / 1.3
        n = 0
        while n < k and x[n] == best[n]:
            n += 1
        want = x[:n].tolist() + [int(best[n])]
        what = f"greedy target, k={k}, V={V}, drafts {x.tolist()}, argmaxes {best.tolist()} [seed {seed}]"
        for s in (1, 2):
            got = _emit(impl, p, q, x, torch.Generator().manual_seed(seed + s), what)
            if got != want:
                pytest.fail(f"{what}: emitted {got}, expected {want} (accept while the draft is the argmax, then "
                            f"the argmax)", pytrace=False)


@pytest.mark.timeout(HEAVY_TIMEOUT_S)
@pytest.mark.points(12)
def test_accept_reject_reproduces_the_target_distribution(impl):
    seed = seeds.randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    N = 6000
    for trial, k in enumerate((2, rng.randint(1, 3))):
        V = rng.randint(5, 12)
        p = _random_dist(gen, k + 1, V, 1.5, 1)  # the target
        q = _random_dist(gen, k, V, 2.5, 1)  # a draft that disagrees with it
        what = f"run {trial}: k={k}, V={V} [seed {seed}]"
        rounds = _run_rounds(impl, p, q, N, seed + trial, what)
        _assert_follows([r[0] for r in rounds], p[0], f"{what}: the first emitted token must follow p_1")
        _assert_follows([r[1] for r in rounds if len(r) > 1], p[1],
                        f"{what}: the second emitted token (first draft accepted) must follow p_2")
        bonus = [r[k] for r in rounds if len(r) == k + 1]
        if len(bonus) >= 500:
            _assert_follows(bonus, p[k], f"{what}: the bonus token (all drafts accepted) must follow p_(k+1)")


@pytest.mark.timeout(HEAVY_TIMEOUT_S)
@pytest.mark.points(10)
def test_accept_reject_acceptance_rates(impl):
    seed = seeds.randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    # accepted counts: P(at least j accepted) = a_1 ... a_j with a_i = sum_x min(p_i, q_i)
    k, V = rng.randint(2, 4), rng.randint(4, 10)
    p, q = _random_dist(gen, k + 1, V, 1.2, 0), _random_dist(gen, k, V, 1.2, 1)
    a = torch.minimum(p[:k], q).sum(-1).double()
    reach = torch.cat([torch.ones(1, dtype=torch.float64), a.cumprod(0)])  # P(n >= j), j = 0..k
    probs = reach - torch.cat([reach[1:], torch.zeros(1, dtype=torch.float64)])
    what = f"k={k}, V={V}, acceptance rates {a.numpy().round(3).tolist()} [seed {seed}]"
    rounds = _run_rounds(impl, p, q, 5000, seed, what)
    _assert_follows([len(r) - 1 for r in rounds], probs,
                    f"{what}: the number of accepted drafts must follow P(n >= j) = a_1 ... a_j")
    # q == p: every draft is accepted, the bonus follows p_(k+1)
    same = _run_rounds(impl, p, p[:k].clone(), 2000, seed + 1, f"q == p [seed {seed}]")
    if any(len(r) != k + 1 for r in same):
        pytest.fail(f"q == p [seed {seed}]: a draft drawn from the target's own distribution must always be "
                    f"accepted (min(1, p/q) = 1)", pytrace=False)
    _assert_follows([r[k] for r in same], p[k], f"q == p [seed {seed}]: the bonus token must follow p_(k+1)")
    # a one-hot guess x (an n-gram proposer): accepted with probability p(x); otherwise x is excluded
    x = int(torch.multinomial(p[0], 1, generator=gen))
    onehot = torch.zeros(1, V)
    onehot[0, x] = 1.0
    rounds = [_emit(impl, p[:2], onehot, torch.tensor([x]), torch.Generator().manual_seed(seed + 7 + i),
                    f"one-hot guess [seed {seed}]") for i in range(3000)]
    accepted = sum(len(r) == 2 for r in rounds)
    px = float(p[0, x])
    _assert_follows([len(r) - 1 for r in rounds], torch.tensor([1 - px, px]),
                    f"one-hot guess {x} with p(x) = {px:.3f} [seed {seed}]: accepted {accepted} of 3000 times")
    rejected = [r[0] for r in rounds if len(r) == 1]
    if x in rejected:
        pytest.fail(f"one-hot guess [seed {seed}]: after rejecting x={x} the residual max(0, p - onehot(x)) gives "
                    f"x probability 0, but it was emitted", pytrace=False)
    # a seeded generator gives the same tokens again
    x3 = _draw(q, gen)
    first = [impl.accept_reject(p, q, x3, torch.Generator().manual_seed(seed + 99)) for _ in range(3)]
    if any([int(t) for t in f] != [int(t) for t in first[0]] for f in first):
        pytest.fail(f"accept_reject with the same seeded generator gave different tokens {first} [seed {seed}]",
                    pytrace=False)


# ================================================================ exercise 4: the token mask
ALPHABET = "abnoesy0123456789"


def _mask_automaton(module: ModuleType, rng: random.Random):
    if rng.random() < 0.3:
        return module.Automaton.digits(rng.randint(1, 4))
    words = {"".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 5)))
             for _ in range(rng.randint(1, 6))}
    return module.Automaton.choices(sorted(words))


def _mask_vocab(rng: random.Random, V: int) -> list[str]:
    """Token 0 is EOS ("<eos>"); the rest 0 to 3 characters (an empty one among them)."""
    out = ["<eos>", ""] + ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 3)))
                           for _ in range(V - 2)]
    return out[:1] + rng.sample(out[1:], len(out) - 1)


def _mask_states(a, rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(len(a.next)) for _ in range(n)]


@pytest.mark.points(5)
def test_advance_walks_the_mask_automaton(impl, seeded):
    seed, rng = seeded
    for i in range(40):
        mine, theirs = _mask_automaton(impl, random.Random(seed + i)), _mask_automaton(ref, random.Random(seed + i))
        for s in _mask_states(theirs, rng, 5):
            for text in ["", *("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 4)))
                               for _ in range(6))]:
                want, got = ref.advance(theirs, s, text), impl.advance(mine, s, text)
                if got != want:
                    pytest.fail(f"advance(state {s}, {text!r}) on {theirs.next} gave {got}, expected "
                                f"{want} [seed {seed}]", pytrace=False)


@pytest.mark.points(10)
def test_token_mask_matches_the_reference(impl, seeded):
    seed, rng = seeded
    for i in range(25):
        mine, theirs = _mask_automaton(impl, random.Random(seed + i)), _mask_automaton(ref, random.Random(seed + i))
        vocab = _mask_vocab(rng, rng.randint(8, 70))
        for s in _mask_states(theirs, rng, 4):
            want = ref.token_mask(theirs, s, vocab, 0)
            got = impl.token_mask(mine, s, vocab, 0)
            if not isinstance(got, torch.Tensor) or got.dtype != torch.bool or got.shape != want.shape:
                pytest.fail(f"token_mask must return a ({len(vocab)},) bool tensor, got "
                            f"{getattr(got, 'dtype', type(got))} {tuple(getattr(got, 'shape', ()))} "
                            f"[seed {seed}]", pytrace=False)
            if not torch.equal(got, want):
                bad = (got != want).nonzero()[:, 0].tolist()[:5]
                pytest.fail(f"token_mask(state {s}) wrong for tokens {[(t, vocab[t]) for t in bad]} "
                            f"(automaton {theirs.next}, accepting {sorted(theirs.accepting)}, EOS = 0) "
                            f"[seed {seed}]", pytrace=False)


@pytest.mark.points(8)
def test_pack_bitmask_puts_token_t_in_bit_t_mod_32_of_word_t_div_32(impl):
    seed = seeds.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    for B, V in [(1, 1), (2, 31), (3, 32), (2, 33), (4, 100), (1, 4096)]:
        allowed = torch.rand(B, V, generator=gen) < 0.5
        allowed[0, -1] = True  # the sign bit of a last full word, where V % 32 == 0
        got, want = impl.pack_bitmask(allowed), ref.pack_bitmask(allowed)
        if not isinstance(got, torch.Tensor) or got.dtype != torch.int32 or got.shape != want.shape:
            pytest.fail(f"pack_bitmask of ({B}, {V}) must be a {tuple(want.shape)} int32 tensor, got "
                        f"{getattr(got, 'dtype', type(got))} {tuple(getattr(got, 'shape', ()))} "
                        f"[seed {seed}]", pytrace=False)
        if not torch.equal(got, want):
            pytest.fail(f"pack_bitmask of ({B}, {V}): words {got[0, :4].tolist()}, expected "
                        f"{want[0, :4].tolist()} (bit t % 32 of word t // 32) [seed {seed}]",
                        pytrace=False)


@pytest.mark.points(8)
def test_apply_bitmask_sets_refused_tokens_to_minus_inf(impl):
    seed = seeds.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    for B, V in [(1, 5), (3, 32), (4, 77), (2, 300)]:
        allowed = torch.rand(B, V, generator=gen) < 0.4
        allowed[-1] = True  # a row with everything allowed stays as it was
        logits = torch.randn(B, V, generator=gen)
        before = logits.clone()
        got = impl.apply_bitmask(logits, ref.pack_bitmask(allowed))
        want = before.masked_fill(~allowed, float("-inf"))
        if not torch.equal(logits, before):
            pytest.fail(f"apply_bitmask changed its input logits [seed {seed}]", pytrace=False)
        if not isinstance(got, torch.Tensor) or not torch.equal(got, want):
            pytest.fail(f"apply_bitmask on ({B}, {V}): refused tokens must be -inf and the others "
                        f"unchanged [seed {seed}]", pytrace=False)


@pytest.mark.points(9)
def test_masked_decoding_only_writes_the_automatons_language(impl):
    """Your four functions in a decode loop over random logits: a batch of rows, each with its
    own automaton state, every finished text in the language."""
    seed = seeds.randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    words = sorted({"".join(rng.choice(ALPHABET) for _ in range(rng.randint(2, 5))) for _ in range(5)})
    a = impl.Automaton.choices(words)
    vocab = ["<eos>"] + sorted(set(ALPHABET) | {w[:2] for w in words} | {w[1:] for w in words})
    B = 6
    states, texts, done = [a.start] * B, [""] * B, [False] * B
    for _ in range(12):
        rows = [impl.token_mask(a, s, vocab, 0) for s in states]
        logits = impl.apply_bitmask(torch.randn(B, len(vocab), generator=gen),
                                    impl.pack_bitmask(torch.stack(rows)))
        for b, t in enumerate(logits.argmax(-1).tolist()):
            if done[b]:
                continue
            if t == 0:
                done[b] = True
                continue
            texts[b] += vocab[t]
            states[b] = impl.advance(a, states[b], vocab[t])
            if states[b] is None:
                pytest.fail(f"row {b} sampled {vocab[t]!r}, which the automaton refuses after "
                            f"{texts[b][:-len(vocab[t])]!r}: the mask let it through [seed {seed}]",
                            pytrace=False)
    if not all(done) or any(t not in words for t in texts):
        pytest.fail(f"decoding {words} gave {texts} (finished: {done}) [seed {seed}]", pytrace=False)
