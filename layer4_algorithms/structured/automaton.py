"""Constrained decoding at teaching size (lab 4's exercise 4, and its answers).

The engine's structured outputs (grammar.py, bitmask.py) ask llguidance which tokens a JSON
schema allows next. Underneath is one idea, written here on a small automaton:

* `Automaton` — a deterministic automaton over characters (states, a start, the accepting
  states, a transition table); `Automaton.choices(["yes", "no"])` builds one that accepts
  exactly those strings, `Automaton.digits(n)` one for 1 to n digits.
* `advance(automaton, state, text)` — walk the characters of a token; None when one is refused.
* `token_mask(automaton, state, vocab, eos_id)` — (V,) bools: which tokens keep the text inside
  the language (a token is a string of characters; the EOS token is allowed only in an
  accepting state, and the empty string never: it would not advance).
* `pack_bitmask(allowed)` — (B, V) bools -> (B, ceil(V / 32)) int32, token t in bit t % 32 of
  word t // 32 (the layout llguidance and xgrammar fill and the GPU unpacks).
* `apply_bitmask(logits, bitmask)` — (B, V) logits with every refused token at -inf.

Every state of these automata is live (it can still reach an accepting state), so a token that
the automaton accepts can always be continued: the mask never walks into a dead end.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


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
