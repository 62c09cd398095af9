"""Which replica gets a request: round_robin, least_loaded, prefix_aware.

A policy sees the replicas that may take work now (healthy, not draining) and the request's
JSON body, and returns one of them. They differ in what they know:

- **round_robin** knows nothing: each replica in turn. Even spread of *requests*, blind to
  how long each one runs and to what each replica has cached.
- **least_loaded** knows load: the replica with the fewest requests in flight through this
  router (ties: the one picked least recently). Long requests stop piling up on one replica.
- **prefix_aware** knows where a conversation has been: the replica that served a
  conversation's earlier turns holds its prompt's KV blocks in its prefix cache, so the next
  turn's prompt (the same messages plus the new ones) is mostly prefilled already *there*
  and nowhere else. The rule: key = what every turn of a conversation starts with (the
  messages up to and including the first user message, or a prompt up to its first blank
  line; at most `PREFIX_CHARS` characters, see `prefix_key`); home = the replica
  with the highest hash(key, replica url) (rendezvous hashing: a replica joining or leaving
  moves only the keys it wins or held); but if home has more than `load_bound` requests in
  flight beyond the least-loaded replica, the least-loaded one takes it (a hot conversation
  must not overload one replica while the others idle).
"""
from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from typing import Any, Protocol

PREFIX_CHARS = 256  # ~80 course-model tokens: the system prompt and the first user turn
POLICIES = ("round_robin", "least_loaded", "prefix_aware")


class Loaded(Protocol):
    """What a policy needs of a replica."""

    url: str
    in_flight: int
    picked: int  # times chosen (least_loaded breaks ties by it)


def prefix_key(body: dict[str, Any], chars: int = PREFIX_CHARS) -> str:
    """What stays the same across a conversation's turns: the messages up to and including
    the first user message ("role: content" lines), or a prompt up to its first blank line
    (the first speech of a scene); at most `chars` characters either way. Later turns only
    append to a conversation, so every turn has the same key."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            parts.append(f"{m.get('role', '')}: {m.get('content', '')}\n")
            if m.get("role") == "user":
                break
        text = "".join(parts)
    else:
        prompt = body.get("prompt", "")
        text = prompt if isinstance(prompt, str) else repr(prompt)
        cut = text.find("\n\n")
        text = text if cut < 0 else text[:cut + 2]
    return text[:chars]


def hash_score(key: str, url: str) -> int:
    """A replica's score for a key (rendezvous hashing): 8 bytes of BLAKE2b, big-endian."""
    return int.from_bytes(hashlib.blake2b(f"{key}|{url}".encode(), digest_size=8).digest(),
                          "big")


def rendezvous(key: str, urls: Sequence[str]) -> str:
    """The url with the highest hash_score(key, url): stable as long as that url stays."""
    return max(urls, key=lambda url: hash_score(key, url))


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, replicas: Sequence[Loaded], body: dict[str, Any]) -> Loaded:
        return replicas[next(self._turn) % len(replicas)]


class LeastLoaded:
    name = "least_loaded"

    def choose(self, replicas: Sequence[Loaded], body: dict[str, Any]) -> Loaded:
        return min(replicas, key=lambda r: (r.in_flight, r.picked))


class PrefixAware:
    """Home by rendezvous hash of the prefix key; the least-loaded replica when home has more
    than `load_bound` requests in flight beyond it."""

    name = "prefix_aware"

    def __init__(self, load_bound: int = 4, chars: int = PREFIX_CHARS) -> None:
        if load_bound < 0:
            raise ValueError(f"load_bound must be >= 0, got {load_bound}")
        self.load_bound, self.chars = load_bound, chars

    def choose(self, replicas: Sequence[Loaded], body: dict[str, Any]) -> Loaded:
        home_url = rendezvous(prefix_key(body, self.chars), [r.url for r in replicas])
        home = next(r for r in replicas if r.url == home_url)
        least = min(replicas, key=lambda r: (r.in_flight, r.picked))
        if home.in_flight > least.in_flight + self.load_bound:
            return least
        return home


def make_policy(name: str, *, load_bound: int = 4) -> RoundRobin | LeastLoaded | PrefixAware:
    """The policy called `name` (one of POLICIES); ValueError for another name."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_aware":
        return PrefixAware(load_bound)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
