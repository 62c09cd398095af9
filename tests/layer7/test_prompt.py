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


def test_play_mode_writes_the_scene_for_the_completions_endpoint() -> None:
    history = [{"role": "user", "content": "Who's there? "},
               {"role": "assistant", "content": "Nay, answer me."},
               {"role": "user", "content": "Long live the king!"}]
    path, body = build_request(history, model="course", temperature=0.5, max_tokens=32,
                               context_len=512, rag_context="[1] (a.md) text",
                               play=Play.parse({"user": "Bernardo", "assistant": "francisco"}))
    assert path == "/v1/completions" and "messages" not in body
    assert body["prompt"] == ("CHORUS.\n[1] (a.md) text\n\nBERNARDO.\nWho's there?\n\n"
                              "FRANCISCO.\nNay, answer me.\n\nBERNARDO.\nLong live the king!"
                              "\n\nFRANCISCO.\n")
    assert body["stop"] == ["\n\n"] and body["max_tokens"] == 32 and body["model"] == "course"


def test_rag_context_goes_first_as_a_system_message() -> None:
    path, body = build_request([{"role": "user", "content": "q"}], model="m",
                               temperature=0.0, max_tokens=8, context_len=None,
                               rag_context="[1] (a.md) text")
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "system", "content": "[1] (a.md) text"},
                                {"role": "user", "content": "q"}]


@pytest.mark.parametrize("raw", [{"user": "", "assistant": "HAMLET"},
                                 {"user": "<b>", "assistant": "HAMLET"}, "HAMLET"])
def test_bad_play_names_are_refused(raw: object) -> None:
    with pytest.raises(ValueError, match="play"):
        Play.parse(raw)
    assert Play.parse(None) is None
