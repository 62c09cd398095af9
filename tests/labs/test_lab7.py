"""Lab 7 grader: the prefix-aware routing choice and fitting a long history into the
context window, against the lab's answer key (labs/lab7_app/lab7_reference.py) on hand-made
cases and fresh random inputs.

Graded through the `impl` fixture (tests/labs/conftest.py): a student's exercises.py under
`stack grade --lab 7`; under plain pytest the answer key. Seeds are drawn afresh
every run and printed in every failure message. No test times anything.

* prefix_key: hand cases, then every turn of random conversations has one key (equal to
  the reference's).
* choose_replica: home by rendezvous hash (checked against a brute-force max), stable when
  another replica leaves, the load bound both ways, random loads equal to the reference.
* fit_history: hand cases (system messages kept, all of them; oldest dropped; starts with a
  user message; too long -> ValueError; a counter with a per-prompt cost), random histories
  (one to three system messages) with an additive word counter or one with a per-prompt
  cost against a brute-force oracle, and a 40-turn chat counted with the course model's own
  tokenizer.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from .references import import_reference
from .submission_guard import detached

REFERENCE = "lab7_reference"
ref = import_reference(REFERENCE)
seeds = random.SystemRandom()
TOKENIZER = Path(__file__).resolve().parents[2] / "models" / "course-target" / "tokenizer.json"


def msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def random_chat(rng: random.Random, turns: int, system: bool = True) -> list[dict[str, str]]:
    """A chat of `turns` user/assistant pairs, after one to three system messages (a
    deployment's prompt, then an app's, then a tool's: all of them lead) if `system`."""
    words = ["good", "my", "lord", "Verona", "night", "sweet", "love", "O", "death", "sword"]
    out = [msg("system", " ".join(rng.choices(words, k=rng.randrange(1, 8))))
           for _ in range(rng.choice([1, 1, 2, 3]) if system else 0)]
    for _ in range(turns):
        out.append(msg("user", " ".join(rng.choices(words, k=rng.randrange(1, 12)))))
        out.append(msg("assistant", " ".join(rng.choices(words, k=rng.randrange(1, 20)))))
    return out


# ============================================================ exercise 1: the conversation key
@pytest.mark.points(10)
def test_prefix_key_hand_cases(impl):
    chat = [msg("system", "Be brief."), msg("user", "Hi"), msg("assistant", "Hail"),
            msg("user", "More")]
    assert impl.prefix_key(chat) == "system: Be brief.\nuser: Hi\n"
    assert impl.prefix_key(chat[1:2]) == "user: Hi\n"
    assert impl.prefix_key([msg("user", "x" * 500)]) == ("user: " + "x" * 500)[:256]
    assert impl.prefix_key(chat, chars=10) == "system: Be"
    assert impl.prefix_key([]) == ""


@pytest.mark.points(10)
def test_prefix_key_is_the_same_for_every_turn(impl, seeded):
    seed, rng = seeded
    for _ in range(50):
        chat = random_chat(rng, rng.randrange(1, 6), system=rng.random() < 0.7)
        keys = {impl.prefix_key(chat[:i]) for i in range(len(chat) + 1)
                if any(m["role"] == "user" for m in chat[:i])}
        assert keys == {ref.prefix_key(chat)}, f"seed {seed}: one conversation, keys {keys}"


# ============================================================ exercise 2: the routing choice
URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


@pytest.mark.points(15)
def test_choose_replica_goes_home_by_rendezvous_hash(impl, seeded):
    seed, rng = seeded
    for _ in range(100):
        key = f"conversation {rng.random()}"
        home = max(URLS, key=lambda u: ref.hash_score(key, u))
        got = impl.choose_replica(key, dict.fromkeys(URLS, 0))
        assert got == home, f"seed {seed}: key {key!r} went to {got}, its home is {home}"
        fewer = [u for u in URLS if u != URLS[0]]  # replica 1 leaves: only its keys move
        after = impl.choose_replica(key, dict.fromkeys(fewer, 0))
        assert after == home or home == URLS[0], f"seed {seed}: {key!r} moved needlessly"
    with pytest.raises(ValueError):
        impl.choose_replica("k", {})


@pytest.mark.points(15)
def test_choose_replica_load_bound(impl):
    key = "system: Be brief.\nuser: Hi\n"
    home = ref.choose_replica(key, dict.fromkeys(URLS, 0))
    others = [u for u in URLS if u != home]
    loads = {u: 3 for u in URLS}
    loads[home] = 7  # 7 <= 3 + 4: stays home
    assert impl.choose_replica(key, loads, load_bound=4) == home
    loads[home] = 8  # 8 > 3 + 4: the least loaded (the first of the tied ones)
    assert impl.choose_replica(key, loads, load_bound=4) == others[0]
    loads[others[1]] = 1
    assert impl.choose_replica(key, loads, load_bound=4) == others[1]
    assert impl.choose_replica(key, {home: 1, others[0]: 0}, load_bound=0) == others[0]


@pytest.mark.points(10)
def test_choose_replica_random_loads_match_the_reference(impl, seeded):
    seed, rng = seeded
    for _ in range(300):
        urls = rng.sample(URLS, rng.randrange(1, 5))
        loads = {u: rng.randrange(0, 10) for u in urls}
        key, bound = f"k{rng.randrange(10**6)}", rng.randrange(0, 5)
        got, want = impl.choose_replica(key, loads, bound), ref.choose_replica(key, loads, bound)
        assert got == want, f"seed {seed}: choose_replica({key!r}, {loads}, {bound}) = {got}"


# ============================================================ exercise 3: fitting the history
# The token counters fit_history is given. `detached` gives each a namespace of its own:
# defined here, a function's __globals__ would be this module's, which holds the reference.
@detached
def words(messages) -> int:
    """2 tokens per message (role, separator) + one per word: additive over messages."""
    return sum(len(m["content"].split()) + 2 for m in messages)


@detached
def templated(messages) -> int:
    """words(messages) + 3 for the whole prompt (a chat template's BOS and the assistant's
    header): counting messages one at a time and adding the counts overcounts."""
    return sum(len(m["content"].split()) + 2 for m in messages) + 3


@pytest.mark.points(15)
def test_fit_history_hand_cases(impl):
    s, u1, a1, u2, a2, u3 = (msg("system", "a b"), msg("user", "c d e"), msg("assistant", "f"),
                             msg("user", "g h"), msg("assistant", "i j k"), msg("user", "l"))
    chat = [s, u1, a1, u2, a2, u3]  # costs 4, 5, 3, 4, 5, 3 = 24
    assert impl.fit_history(chat, words, context_len=30, max_tokens=6) == chat
    assert impl.fit_history(chat, words, context_len=29, max_tokens=6) == [s, u2, a2, u3]
    assert impl.fit_history(chat, words, context_len=25, max_tokens=6) == [s, u2, a2, u3]
    # 15 tokens: [s, a2, u3] would fit, but a kept history starts with a user message
    assert impl.fit_history(chat, words, context_len=21, max_tokens=6) == [s, u3]
    assert impl.fit_history(chat[1:], words, context_len=10, max_tokens=6) == [u3]
    with pytest.raises(ValueError):
        impl.fit_history(chat, words, context_len=12, max_tokens=6)
    # every leading system message is kept (4 + 4 + 4 + 5 + 3 = 20 tokens)
    s2 = msg("system", "m n")
    assert impl.fit_history([s, s2, *chat[1:]], words, context_len=26, max_tokens=6) == \
        [s, s2, u2, a2, u3]
    # the counter's cost of the whole prompt decides, not the sum of each message's cost:
    # [s, u2, a2, u3] is 16 + 3 = 19 tokens with the template, the sum of parts 28
    assert impl.fit_history(chat, templated, context_len=25, max_tokens=6) == [s, u2, a2, u3]


def oracle(messages, count, context_len, max_tokens):
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    system, rest = messages[:n], messages[n:]
    fits = [i for i in range(len(rest)) if rest[i]["role"] == "user"
            and count(system + rest[i:]) + max_tokens <= context_len]
    return None if not fits else system + rest[min(fits):]


@pytest.mark.points(15)
def test_fit_history_random_matches_a_brute_force_oracle(impl, seeded):
    seed, rng = seeded
    for _ in range(200):
        chat = random_chat(rng, rng.randrange(1, 10), system=rng.random() < 0.8)
        if rng.random() < 0.3:
            chat = chat[:-1]  # ends with the user's question, as a real request does
        ctx, mt = rng.randrange(10, 150), rng.randrange(1, 20)
        count = rng.choice([words, templated])
        want = oracle(chat, count, ctx, mt)
        if want is None:
            with pytest.raises(ValueError):
                impl.fit_history(chat, count, ctx, mt)
            continue
        got = impl.fit_history(chat, count, ctx, mt)
        assert got == want, f"seed {seed}: fit_history(..., {ctx}, {mt}) kept {len(got)} " \
                            f"messages, expected {len(want)}"


@pytest.mark.points(10)
def test_fit_history_with_the_course_tokenizer(impl):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(TOKENIZER))

    @detached
    def count(messages) -> int:
        return len(tok.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages)).ids)

    rng = random.Random(seeds.randrange(2**32))
    chat = random_chat(rng, 40)
    got = impl.fit_history(chat, count, context_len=512, max_tokens=64)
    assert got == ref.fit_history(chat, count, context_len=512, max_tokens=64)
    assert got[0] == chat[0] and got[-1] == chat[-1] and len(got) < len(chat)
    assert count(got) <= 512 - 64
