"""Turning a stored conversation into the `messages` a model server gets.

Three jobs, kept here so the web routes stay thin:
- **play mode** (the course model speaks in scenes, `NAME.\\nline\\n\\n`): the scene is
  written out here, each speech under its character's name, ending with the heading of the
  model's character, and sent to `/v1/completions` with the blank line as the stop string.
  (The chat endpoint's template always opens the reply as its default assistant, HAMLET,
  and OpenAI's API has no standard field to rename it.);
- **retrieved passages** (RAG) go first, as a system message;
- **the context window**: the oldest turns are dropped until the prompt should fit beside
  `max_tokens` of reply. Tokens are estimated from characters, conservatively (the course
  tokenizer averages ~3.1 characters a token; we assume 2.5), since the app has no tokenizer.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 2.5
PER_MESSAGE_TOKENS = 4  # the speaker heading and separators each message adds
SYSTEM_SPEAKER = "CHORUS"  # who speaks a system message (the RAG passages) in a scene
PLAY_STOP = ("\n\n",)  # a speech ends at a blank line
_NAME = re.compile(r"^[A-Za-z][A-Za-z .'-]{0,39}$")


@dataclass(frozen=True)
class Play:
    """Play mode: the user speaks as `user`, the model answers as `assistant`."""

    user: str
    assistant: str

    @classmethod
    def parse(cls, raw: Any) -> Play | None:
        """From the page's {"user": ..., "assistant": ...}; None when play mode is off."""
        if not raw:
            return None
        if not isinstance(raw, dict):
            raise ValueError("play must be an object {user, assistant}")
        user, assistant = str(raw.get("user", "")).strip(), str(raw.get("assistant", "")).strip()
        for label, name in (("user", user), ("assistant", assistant)):
            if not _NAME.match(name):
                raise ValueError(f"play.{label} must be a character name of letters "
                                 f"(up to 40), got {name!r}")
        return cls(user.upper(), assistant.upper())


def estimate_tokens(text: str) -> int:
    """A deliberately high estimate of how many tokens `text` takes."""
    return int(len(text) / CHARS_PER_TOKEN) + PER_MESSAGE_TOKENS


def fit_history(history: list[dict[str, str]], budget_tokens: int) -> list[dict[str, str]]:
    """The longest suffix of `history` within `budget_tokens` (always the last message).

    A reply only makes sense after the user's latest words, so those are kept even alone;
    a too-long last message is the server's to refuse, with its own clear error.
    """
    kept: list[dict[str, str]] = []
    used = 0
    for message in reversed(history):
        cost = estimate_tokens(message["content"])
        if kept and used + cost > budget_tokens:
            break
        kept.append(message)
        used += cost
    return kept[::-1]


def render_scene(messages: list[dict[str, str]], play: Play) -> str:
    """The conversation as a play script, in the course model's own format, ending with the
    heading of the model's character (what it continues)."""
    speaker = {"user": play.user, "assistant": play.assistant, "system": SYSTEM_SPEAKER}
    speeches = [f"{speaker[m['role']]}.\n{m['content'].strip()}\n\n" for m in messages]
    return "".join(speeches) + f"{play.assistant}.\n"


def build_request(history: list[dict[str, str]], *, model: str, temperature: float,
                  max_tokens: int, context_len: int | None, play: Play | None = None,
                  rag_context: str | None = None,
                  system_prompt: str | None = None) -> tuple[str, dict[str, Any]]:
    """The endpoint (`/v1/chat/completions` or, in play mode, `/v1/completions`) and body.
    The conversation's system prompt and the retrieved passages go first, as system
    messages, and are never dropped to make room."""
    budget = (context_len or 4096) - max_tokens
    system = [{"role": "system", "content": text} for text in (system_prompt, rag_context)
              if text and text.strip()]
    for message in system:
        budget -= estimate_tokens(message["content"])
    messages = system + fit_history(history, max(budget, 0))
    body: dict[str, Any] = {"model": model, "temperature": temperature,
                            "max_tokens": max_tokens}
    if play is not None:
        body.update(prompt=render_scene(messages, play), stop=list(PLAY_STOP))
        return "/v1/completions", body
    body["messages"] = messages
    return "/v1/chat/completions", body
