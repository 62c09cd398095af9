"""Which KV block holds which tokens: block ids and reference counts only, no tensors.

The cache is a pool of num_blocks blocks of block_size token slots each (paged_cache.py
owns the tensors). A sequence's block_table lists its blocks in order: position p lives in
block block_table[p // block_size], slot p % block_size. Blocks need not be contiguous, so
a sequence grows one block at a time and nothing is reserved for tokens it may never make.

Reference counts let sequences share blocks:
* parallel sampling (n > 1): the children of a prompt share its blocks (`fork`). The last,
  partly filled block is still written to, so the first child to write into a shared block
  gets its own copy first (copy-on-write: `allocate_slots` returns the (src, dst) pairs the
  cache must copy before the step runs).
* prefix caching: a *full*, computed block is registered under a hash of its tokens chained
  to its parent block's hash, hash(parent_hash, tokens) (vLLM's scheme): equal hashes mean
  the whole prefix up to and including the block is equal (the block's key is also stored
  and compared, so a hash collision costs a miss, never a wrong answer). A new sequence
  whose first blocks match shares them and skips their prefill. Full blocks never change,
  so sharing them needs no copy-on-write.

A sequence's block_table list only ever grows in place (appends); every other change (copy-on-
write, truncation, freeing, admission, fork) gives it a new list, so the runner can mirror the
tables in one array and copy only what was appended (block_table_mirror.BlockTableMirror).

A block whose count drops to 0 goes back to the pool: to the free list if it holds nothing
reusable, else to an LRU list of evictable cached blocks, which keep their contents until
the pool runs dry and the least recently used one is taken (its hash forgotten).

Freeing is parked: `free` takes the sequence's table off it at once and keeps the list; its
blocks go back to the pool at the next `drain()`, in the order the frees came. Every method
and property drains first, except the steps a new prompt takes (matching a prefix, admitting
it with no hits, taking fresh blocks while the free list has them), which parked blocks
cannot change: a parked block is still referenced, so it is in neither list, and it would
join the free list's end, the side never taken from first. So a finished prompt's ~128 blocks
(a 2k-token prompt) go back when the engine drains, behind its next launch, not while the
caller waits for the request's output; what anyone reads here is what an immediate free gives.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import repeat, starmap

from ..config import EngineConfig
from ..sequence import Sequence


@dataclass
class PrefixCacheStats:
    """Lookups at admission (first admission only, not recomputation after preemption):
    prompt tokens queried and tokens found in the cache (whole blocks)."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    queried_requests: int = 0
    hit_requests: int = 0  # requests with at least one cached block

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockManager:
    """Free list, reference counts, block tables, copy-on-write and the prefix cache for a
    pool of `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int, *,
                 enable_prefix_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # each block's references; a parked free's blocks still count their table (ref_counts:
        # drained). A count of 1 read here is exact: no parked table holds that block.
        self.raw_ref_counts = [0] * num_blocks
        self._parked: list[list[int]] = []  # tables of freed sequences, oldest first
        self._hash_of: list[int | None] = [None] * num_blocks
        # block -> (parent hash, tokens): the exact check behind a hash
        self._key_of: dict[int, tuple] = {}
        self._cached: dict[int, int] = {}  # hash -> block
        self._free: deque[int] = deque(range(num_blocks))
        # refcount-0 cached blocks, oldest first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.stats = PrefixCacheStats()

    @classmethod
    def from_config(cls, config: EngineConfig) -> BlockManager:
        """The engine's pool: config.num_blocks (resolved) of config.block_size tokens."""
        if config.num_blocks is None:
            raise ValueError("EngineConfig.num_blocks is None: LLM resolves it from the byte "
                             "budget; set it when you build a BlockManager yourself")
        return cls(config.num_blocks, config.block_size,
                   enable_prefix_caching=config.enable_prefix_caching)

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def ref_counts(self) -> list[int]:
        """Each block's reference count (parked frees applied)."""
        self.drain()
        return self.raw_ref_counts

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones plus evictable cached ones."""
        self.drain()
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        self.drain()
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def hash_block(parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    # ---- prefix cache ------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks equal to seq's first full blocks. At most (num_tokens - 1) tokens are
        matched: the last token must run through the model for its logits, and its k, v must
        not be written into a block other sequences share."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent, bs = None, self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            key = (parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            block = self._cached.get(self.hash_block(*key))
            if block is None or self._key_of[block] != key:
                break
            hits.append(block)
            parent = self._hash_of[block]
        return hits

    def can_admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        """Would admit(seq, hits) + allocate_slots(seq, num_new_tokens) fit? Cached hits that
        nobody references are counted too: sharing them takes them off the evictable list."""
        new = self.blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        if self._parked:  # (parked blocks only add free ones: no hit, room already: yes)
            if not hits and new <= len(self._free) + len(self._evictable):
                return True
            self.drain()
        idle_hits = sum(1 for b in hits if self.raw_ref_counts[b] == 0)
        return idle_hits + new <= len(self._free) + len(self._evictable)

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Give a waiting sequence (no blocks) the cached prefix blocks `hits`: they count as
        computed and are skipped by prefill."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        if hits and self._parked:
            self.drain()
        for b in hits:
            self._ref(b)
        seq.block_table = list(hits)
        seq.block_hashes = [self._hash_of[b] for b in hits]
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.stats.queried_tokens += seq.num_tokens
            self.stats.hit_tokens += seq.num_computed_tokens
            self.stats.queried_requests += 1
            self.stats.hit_requests += bool(hits)

    def commit(self, seq: Sequence) -> None:
        """Register seq's newly full, computed blocks in the prefix cache (after a step).
        A block whose prefix is already cached elsewhere stays unregistered (freed, not cached)."""
        if not self.enable_prefix_caching:
            return
        self.drain()
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            key = (seq.block_hashes[-1] if i else None, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            h, block = self.hash_block(*key), seq.block_table[i]
            if self._hash_of[block] is None and h not in self._cached:
                self._cached[h], self._hash_of[block], self._key_of[block] = block, h, key
            seq.block_hashes.append(h)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody is using (benchmarks: a cold cache)."""
        self.drain()
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
            self._free.append(block)

    # ---- allocation ---------------------------------------------------------------------------
    def _write_plan(self, seq: Sequence, num_new_tokens: int) -> tuple[int, list[int]]:
        """For seq's next num_new_tokens writes: (blocks its table must then hold, indices of
        the table entries those writes touch that other sequences share)."""
        table, need = seq.block_table, self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        first = seq.num_computed_tokens // self.block_size
        return need, [i for i in range(first, min(need, len(table)))
                      if self.raw_ref_counts[table[i]] > 1]

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks allocate_slots(seq, num_new_tokens) takes from the pool (new + copies)."""
        self.drain()
        need, shared = self._write_plan(seq, num_new_tokens)
        return max(need - len(seq.block_table), 0) + len(shared)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Make room for seq's next num_new_tokens tokens (positions num_computed..+n-1).
        Returns the copy-on-write pairs (src, dst) to copy before writing, or None (nothing
        changed) when the pool is too small. Runs for every sequence every step: the write
        range is worked out once."""
        if num_new_tokens == 1:  # a decode: usually its slot is in its own last block already
            table, i = seq.block_table, seq.num_computed_tokens // self.block_size
            if i < len(table) and self.raw_ref_counts[table[i]] == 1:
                return []
        if self._parked and (seq.num_computed_tokens // self.block_size < len(seq.block_table)
                             or self.blocks_for(seq.num_computed_tokens + num_new_tokens)
                             - len(seq.block_table) > len(self._free)):
            self.drain()  # (else: no table entry of seq's is written, fresh blocks suffice)
        need, shared = self._write_plan(seq, num_new_tokens)
        if max(need - len(seq.block_table), 0) + len(shared) > len(self._free) + len(
                self._evictable):
            return None
        copies = []
        if shared:  # a new list: tables only grow in place (the runner mirrors them)
            seq.block_table = list(seq.block_table)
        for i in shared:
            old, new = seq.block_table[i], self._take()
            copies.append((old, new))
            self._unref(old)
            seq.block_table[i] = new
        missing = need - len(seq.block_table)
        if missing > 0:  # (in place: the list only grows)
            seq.block_table += self._take_many(missing)
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares all of parent's blocks (one more reference each)."""
        self.drain()
        for b in parent.block_table:
            self._ref(b)
        child.block_table = list(parent.block_table)

    def free(self, seq: Sequence) -> None:
        """Drop all of seq's blocks (finish, abort, preemption): its table is empty at once,
        its blocks return to the pool at the next drain (module docstring)."""
        if seq.block_table:
            self._parked.append(seq.block_table)
        seq.block_table, seq.block_hashes = [], []

    def drain(self) -> None:
        """Return the parked frees' blocks to the pool, in the order they were freed; each
        table's in reverse order, so the LRU list evicts a sequence's tail before its prefix,
        the part others may share."""
        if not self._parked:
            return
        parked, self._parked = self._parked, []
        refs, hashed, evictable, free = self.raw_ref_counts, self._hash_of, self._evictable, \
            self._free
        for table in parked:
            for b in reversed(table):  # _unref, inlined: a prompt frees ~100 blocks at once
                count = refs[b]
                if count < 1:
                    raise RuntimeError(f"block {b} freed more often than it was referenced")
                refs[b] = count - 1
                if count == 1:
                    if hashed[b] is not None:
                        evictable[b] = None
                    else:
                        free.append(b)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """seq's KV is valid for its first num_tokens tokens only (speculative rollback): keep
        ceil(num_tokens / block_size) blocks, free the rest (they hold rejected slots only)."""
        self.drain()
        keep = self.blocks_for(num_tokens)
        if keep >= len(seq.block_table):
            del seq.block_hashes[num_tokens // self.block_size:]
            return
        for b in reversed(seq.block_table[keep:]):
            self._unref(b)
        seq.block_table = seq.block_table[:keep]  # a new list (tables only grow in place)
        del seq.block_hashes[num_tokens // self.block_size:]

    # ---- reference counting -----------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:  # evict the least recently used cached block
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
        self.raw_ref_counts[block] = 1
        return block

    def _take_many(self, k: int) -> list[int]:
        """k blocks, as k _take() calls would give them (a prompt's ~100 in one go)."""
        free = self._free
        if len(free) < k:  # evictions among them
            return [self._take() for _ in range(k)]
        blocks = list(starmap(free.popleft, repeat((), k)))  # (a C-level loop)
        refs = self.raw_ref_counts
        for b in blocks:
            refs[b] = 1
        return blocks

    def _ref(self, block: int) -> None:
        refs = self.raw_ref_counts  # (callers drained first)
        if refs[block] == 0:
            self._evictable.pop(block)  # only cached blocks are reachable with no references
        refs[block] += 1

    def _unref(self, block: int) -> None:
        refs = self.raw_ref_counts  # (callers drained first)
        if refs[block] < 1:
            raise RuntimeError(f"block {block} freed more often than it was referenced")
        refs[block] -= 1
        if refs[block] == 0:
            if self._hash_of[block] is not None:
                self._evictable[block] = None  # most recently used: evicted last
            else:
                self._free.append(block)

    def _uncache(self, block: int) -> None:
        h = self._hash_of[block]
        if h is not None and self._cached.get(h) == block:
            del self._cached[h]
        self._hash_of[block] = None
        self._key_of.pop(block, None)
