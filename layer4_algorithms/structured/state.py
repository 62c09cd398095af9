"""One sequence's place in its grammar: advanced by every token the sequence accepts.

The engine keeps a `GrammarState` on each constrained `Sequence` (`seq.grammar`):

    before sampling   `fill(row)` writes which tokens may come next into a bitmask row
    after a token     `accept(token)` advances the parser (Sequence.append_token calls it,
                      as `accept_at(token, position)`: once per output position)
    speculation       `fill_drafts(rows, drafts)` masks the verification rows, each for the
                      state after the drafts before it, and leaves the state as it was
    a fork (n > 1)    `fork()`: a sibling starting from the same (fresh) state

Preemption by recomputation keeps a sequence's tokens, and the prefix cache only changes
which KV is recomputed, so neither touches the grammar: the state follows the tokens, which
neither changes. Only accepted tokens advance it (speculative drafts are rolled back), so
there is nothing to undo. A token the grammar refuses (it cannot be sampled under the mask,
but a state can fail) leaves the state failed; its mask then allows only EOS, ending the
sequence instead of letting it run unconstrained.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import llguidance


class GrammarState:
    """compiled: the Future of the compiled grammar's fresh matcher (GrammarCompiler.compile);
    the state copies it when first needed, waiting for the compile only then. lane: which of
    the constraint's compiles it is (grammar.py: rows of different lanes fill in parallel);
    relane: () -> (Future, lane) of the next lane's compile, for forks."""

    def __init__(self, compiled: Future, eos_token_ids: tuple[int, ...], *, lane: int = 0,
                 relane: Callable[[], tuple[Future, int]] | None = None) -> None:
        self._compiled = compiled
        self.lane = lane
        self._relane = relane
        self._matcher: llguidance.LLMatcher | None = None
        self.eos_token_ids = eos_token_ids
        self.num_accepted = 0
        self.position = 0  # output positions seen by accept_at
        self.failed: str | None = None  # why the state stopped following the grammar

    @property
    def matcher(self) -> llguidance.LLMatcher:
        """The sequence's own matcher (a copy of the compiled one; waits for the compile)."""
        if self._matcher is None:
            try:
                self._matcher = self._compiled.result().deep_copy()
            except Exception as e:  # noqa: BLE001 - checked when added: only a limit hit
                self._matcher = FAILED
                self.failed = f"the grammar did not compile: {e}"
        return self._matcher

    @property
    def ready(self) -> bool:
        """The compile has finished (a mask would not wait)."""
        return self._matcher is not None or self._compiled.done()

    def fork(self) -> GrammarState:
        """A sibling at the compiled grammar's start (parallel sampling forks before the
        first output token)."""
        if self.num_accepted:
            raise RuntimeError("a grammar state forks before its first token")
        compiled, lane = self._relane() if self._relane else (self._compiled, self.lane)
        return GrammarState(compiled, self.eos_token_ids, lane=lane, relane=self._relane)

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False (and failed) if the grammar refuses it."""
        if self.failed:
            return False
        m = self._matcher or self.matcher
        if token in self.eos_token_ids and (m.is_stopped() or m.is_accepting()):
            return True  # the end: nothing left to match
        if not m.consume_token(int(token)):
            self.failed = m.get_error() or f"token {token} refused"
            return False
        self.num_accepted += 1
        return True

    def accept_at(self, token: int, position: int) -> bool:
        """accept(token) as the output's token number `position` (0-based), once: a second
        call for a position already seen does nothing (the engine advances a state as soon as
        a step's tokens reach the host, to fill the next mask sooner, and again when it
        appends them). On the engine's thread, which also fills the masks."""
        if position < self.position:
            return self.failed is None
        self.position = position + 1
        return self.accept(token)

    @property
    def is_accepting(self) -> bool:
        """The text so far is a complete match (EOS may come now)."""
        return self.failed is None and self.matcher.is_accepting()

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into row (W,) int32: bit t % 32 of word t // 32."""
        if self.failed or self.matcher.is_error():
            self.failed = self.failed or self.matcher.get_error()
            eos_only(row, self.eos_token_ids)
            return
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def fill_drafts(self, rows: np.ndarray, drafts: list[int]) -> None:
        """rows (1 + len(drafts), W): row j allows what may follow the drafts before j. Past
        a draft the grammar refuses, the rows are left allowing everything (that draft is
        rejected by its own row's mask, so later rows are never used). The state is unchanged."""
        rows[:] = -1
        taken = 0
        for j in range(len(drafts) + 1):
            self.fill(rows[j])
            if j == len(drafts) or self.failed:
                break
            if self.matcher.is_stopped() or not self.matcher.try_consume_tokens([drafts[j]]):
                break
            taken += 1
        if taken:
            self.matcher.rollback(taken)


class _Failed:
    """The matcher of a grammar that did not compile: in error, so its rows allow only EOS."""

    def is_error(self) -> bool:
        return True

    def get_error(self) -> str:
        return "the grammar did not compile"

    def is_stopped(self) -> bool:
        return True

    def is_accepting(self) -> bool:
        return False


FAILED = _Failed()


def eos_only(row: np.ndarray, eos_token_ids: tuple[int, ...]) -> None:
    """A mask row that allows only the EOS tokens."""
    row[:] = 0
    for t in eos_token_ids:
        row[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
