"""Building the model request: play-mode names, RAG context, fitting the context window."""
from __future__ import annotations

import pytest

from layer7_app.chat.prompt import Play, build_request, estimate_tokens, fit_history


def test_fit_history_drops_the_oldest_turns_first() -> None:
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i} " + "x" * 96}
               for i in range(10)]
    per = estimate_tokens(history[0]["content"])
    kept = fit_history(history, budget_tokens=3 * per)
    assert kept == history[-3:]
    assert fit_history(history, budget_tokens=0) == history[-1:]  # the last message stays


def test_play_mode_names_every_speaker_and_the_reply() -> None:
    history = [{"role": "user", "content": "Who's there?"}]
    body = build_request(history, model="course", temperature=0.5, max_tokens=32,
                         context_len=512, play=Play.parse({"user": "Bernardo",
                                                           "assistant": "francisco"}))
    assert body["messages"] == [{"role": "user", "content": "Who's there?", "name": "BERNARDO"}]
    assert body["chat_template_kwargs"] == {"user_name": "BERNARDO",
                                            "assistant_name": "FRANCISCO"}
    assert body["max_tokens"] == 32 and body["model"] == "course"


def test_rag_context_goes_first_as_a_system_message() -> None:
    body = build_request([{"role": "user", "content": "q"}], model="m", temperature=0.0,
                         max_tokens=8, context_len=None, rag_context="[1] (a.md) text")
    assert body["messages"][0] == {"role": "system", "content": "[1] (a.md) text"}
    assert "chat_template_kwargs" not in body


@pytest.mark.parametrize("raw", [{"user": "", "assistant": "HAMLET"},
                                 {"user": "<b>", "assistant": "HAMLET"}, "HAMLET"])
def test_bad_play_names_are_refused(raw: object) -> None:
    with pytest.raises(ValueError, match="play"):
        Play.parse(raw)
    assert Play.parse(None) is None
