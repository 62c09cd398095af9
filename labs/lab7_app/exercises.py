"""Lab 7 — the app: your answers.

Three exercises, in the order `lab7.ipynb` teaches them:

1. `prefix_key` — what stays the same across a conversation's turns, so the router can
   send every turn to the replica whose prefix cache holds the conversation.
2. `choose_replica` — the prefix-aware choice: the conversation's home replica by
   rendezvous hashing (`hash_score`, given), unless home is too far above the least-loaded.
3. `fit_history` — a long chat in a fixed context window: keep the system prompt, drop the
   oldest turns, count tokens with the model's tokenizer (`count_tokens`).

Write the code where it says YOUR CODE (each raises NotImplementedError until you do). Keep
the names and signatures: the grader uses them. Grade yourself with `stack grade --lab 7`.
Do not import `layer7_app` (it holds the answers; the grader refuses a file that imports
it). Plain Python and `hashlib` are all you need.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence

Message = dict[str, str]


def hash_score(key: str, url: str) -> int:
    """A replica's score for a key (rendezvous hashing): 8 bytes of BLAKE2b, big-endian."""
    return int.from_bytes(hashlib.blake2b(f"{key}|{url}".encode(), digest_size=8).digest(),
                          "big")


# ---- Exercise 1: what stays the same across a conversation's turns --------------------------
def prefix_key(messages: Sequence[Message], chars: int = 256) -> str:
    """"role: content\\n" for each message up to and including the first user message,
    joined, cut to `chars` characters. Every turn of a conversation has the same key."""
    # YOUR CODE
    raise NotImplementedError("exercise 1: prefix_key")


# ---- Exercise 2: the prefix-aware choice ----------------------------------------------------
def choose_replica(key: str, in_flight: Mapping[str, int], load_bound: int = 4) -> str:
    """The replica url for `key`: home = the url with the highest hash_score(key, url); but
    if home has more than `load_bound` requests in flight beyond the least-loaded replica
    (the first such url in `in_flight`'s order), that one. ValueError with no replicas."""
    # YOUR CODE
    raise NotImplementedError("exercise 2: choose_replica")


# ---- Exercise 3: fit a long history into the context window ---------------------------------
def fit_history(messages: Sequence[Message], count_tokens: Callable[[list[Message]], int],
                context_len: int, max_tokens: int) -> list[Message]:
    """Drop the oldest turns until the prompt fits beside the reply: the leading system
    messages are always kept; of the rest, keep the longest suffix that starts with a user
    message and for which count_tokens(system + suffix) + max_tokens <= context_len.
    ValueError if even the system messages and the last user message alone do not fit."""
    # YOUR CODE
    raise NotImplementedError("exercise 3: fit_history")
