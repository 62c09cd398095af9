"""The routing policies on their own: what each one chooses, and why."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from layer7_app.router import POLICIES, make_policy, prefix_key
from layer7_app.router.policies import rendezvous


@dataclass
class Fake:
    url: str
    in_flight: int = 0
    picked: int = 0


def replicas(n: int = 3) -> list[Fake]:
    return [Fake(f"http://127.0.0.1:{8000 + i}") for i in range(n)]


def convo(n_turns: int, topic: str) -> dict:
    msgs = [{"role": "system", "content": f"You are a player in a play about {topic}."}]
    for i in range(n_turns):
        msgs += [{"role": "user", "content": f"Speak of {topic}, line {i}."},
                 {"role": "assistant", "content": f"Of {topic} I say {i}."}]
    return {"model": "course", "messages": msgs}


def test_round_robin_takes_turns():
    rs, p = replicas(), make_policy("round_robin")
    assert [p.choose(rs, {}).url for _ in range(6)] == [r.url for r in rs] * 2


def test_least_loaded_picks_fewest_in_flight_then_least_picked():
    rs, p = replicas(), make_policy("least_loaded")
    rs[0].in_flight, rs[1].in_flight, rs[2].in_flight = 3, 1, 2
    assert p.choose(rs, {}) is rs[1]
    rs[1].in_flight = 3
    rs[0].picked, rs[1].picked, rs[2].picked = 5, 2, 0
    rs[2].in_flight = 3
    assert p.choose(rs, {}) is rs[2]  # all tied on load: the least picked


def test_prefix_aware_keeps_a_conversation_home_and_spreads_conversations():
    rs, p = replicas(), make_policy("prefix_aware")
    for topic in ("Verona", "Denmark", "Scotland", "Rome", "Athens", "Venice"):
        homes = {p.choose(rs, convo(turns, topic)).url for turns in range(1, 8)}
        assert len(homes) == 1, f"{topic}'s turns went to {homes}"
    homes = {p.choose(rs, convo(1, f"topic {i}")).url for i in range(40)}
    assert len(homes) == 3, "40 conversations should use all 3 replicas"


def test_prefix_aware_leaves_an_overloaded_home_and_returns_after():
    rs, p = replicas(), make_policy("prefix_aware", load_bound=2)
    body = convo(2, "Verona")
    home = p.choose(rs, body)
    home.in_flight = 3  # 3 > 0 + 2: too far above the others
    other = p.choose(rs, body)
    assert other is not home and other.in_flight == 0
    home.in_flight = 2  # within the bound again
    assert p.choose(rs, body) is home


def test_prefix_aware_moves_only_the_keys_of_a_replica_that_leaves():
    urls = [f"http://r{i}" for i in range(3)]
    keys = [f"conversation {i}" for i in range(200)]
    before = {k: rendezvous(k, urls) for k in keys}
    after = {k: rendezvous(k, urls[:2]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == urls[2] for k in moved)


def test_prefix_key_reads_messages_or_prompt():
    assert prefix_key({"prompt": "ROMEO.\nHi"}) == "ROMEO.\nHi"
    assert prefix_key({"prompt": "ROMEO.\nHi\n\nJULIET.\nHo"}) == "ROMEO.\nHi\n\n"
    two = [{"role": "system", "content": "s"}, {"role": "user", "content": "x"},
           {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}]
    assert prefix_key({"messages": two}) == "system: s\nuser: x\n"
    assert len(prefix_key({"prompt": "a" * 1000})) == 256
    assert prefix_key({}) == ""


def test_unknown_policy_is_a_clear_error():
    assert set(POLICIES) == {"round_robin", "least_loaded", "prefix_aware"}
    with pytest.raises(ValueError, match="unknown policy 'random'"):
        make_policy("random")


def test_stack_route_user_errors_are_one_line_exit_2(capsys):
    from layer7_app.router import route_main
    assert route_main([]) == 2
    assert route_main(["--min-replicas", "2"]) == 2
    assert route_main(["--model", "course", "--min-replicas", "3", "--max-replicas", "2"]) == 2
    assert route_main(["--replica", "ftp://x"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()  # errors go to stderr, one line each
    assert out == "" and len(lines) == 4 and all(line.startswith("error: ") for line in lines), lines
