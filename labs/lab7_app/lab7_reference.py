"""Lab 7's answer key: what plain `pytest` grades (tests/labs/test_lab7.py's REFERENCE) and
what `lab7.ipynb` runs with LLM_STACK_LAB_REFERENCE=1. A submission that imports it earns
nothing. Each answer is a simplified twin of a part the app runs; what it leaves out, and
where the real one is:

- `prefix_key`, `choose_replica`: the prefix-aware routing choice over a message list and a
  dict of loads. The real one is `layer7_app/router/policies.py` (`prefix_key` of a whole
  request body, prompts included; `PrefixAware.choose` over replica objects, ties broken by
  how often each was picked). `hash_score`, given in exercises.py, is the router's own
  (`layer7_app.router.hash_score`), repeated here so that the key needs plain Python only.
- `fit_history`: dropping the oldest turns with a real token count. The real one is
  `layer7_app/chat/prompt.py`'s `fit_history` (the app has no tokenizer: it estimates tokens
  from characters, and keeps the last message even alone).
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
    parts = []
    for m in messages:
        parts.append(f"{m['role']}: {m['content']}\n")
        if m["role"] == "user":
            break
    return "".join(parts)[:chars]


# ---- Exercise 2: the prefix-aware choice ----------------------------------------------------
def choose_replica(key: str, in_flight: Mapping[str, int], load_bound: int = 4) -> str:
    """The replica url for `key`: home = the url with the highest hash_score(key, url); but
    if home has more than `load_bound` requests in flight beyond the least-loaded replica
    (the first such url in `in_flight`'s order), that one. ValueError with no replicas."""
    if not in_flight:
        raise ValueError("no replicas to choose from")
    home = max(in_flight, key=lambda url: hash_score(key, url))
    least = min(in_flight, key=lambda url: in_flight[url])
    return least if in_flight[home] > in_flight[least] + load_bound else home


# ---- Exercise 3: fit a long history into the context window ---------------------------------
def fit_history(messages: Sequence[Message], count_tokens: Callable[[list[Message]], int],
                context_len: int, max_tokens: int) -> list[Message]:
    """Drop the oldest turns until the prompt fits beside the reply: the leading system
    messages are always kept; of the rest, keep the longest suffix that starts with a user
    message and for which count_tokens(system + suffix) + max_tokens <= context_len.
    ValueError if even the system messages and the last user message alone do not fit."""
    n_sys = 0
    while n_sys < len(messages) and messages[n_sys]["role"] == "system":
        n_sys += 1
    system, rest = list(messages[:n_sys]), list(messages[n_sys:])
    budget = context_len - max_tokens
    best = None
    for start in range(len(rest) - 1, -1, -1):  # longer and longer suffixes
        if rest[start]["role"] != "user":
            continue
        if count_tokens(system + rest[start:]) > budget:
            break  # a longer suffix costs at least as much
        best = start
    if best is None:
        raise ValueError(f"the system prompt and the last user message need more than "
                         f"{budget} tokens ({context_len} context - {max_tokens} for the reply)")
    return system + rest[best:]
