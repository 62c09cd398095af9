"""A conversation out of the app and back in (export as Markdown or JSON, import JSON), and
search over a session's conversations.

The JSON export is the import format: `{"format": "llm-stack.conversation", "version": 1,
"title", "settings", "messages": [{"role", "content", "meta"}]}`. Import checks every field
(roles, sizes) before anything is written, so a bad file is a 400 naming what is wrong.
"""
from __future__ import annotations

from typing import Any

from ..store import ROLES, Conversation, Message, Store

FORMAT, VERSION = "llm-stack.conversation", 1
MAX_MESSAGES, MAX_CHARS = 2000, 100_000
KEPT_SETTINGS = ("model", "temperature", "max_tokens", "play", "system")  # not the branches


def as_json(conv: Conversation, messages: list[Message]) -> dict[str, Any]:
    """The conversation in the import format (the branch on screen)."""
    return {"format": FORMAT, "version": VERSION, "title": conv.title,
            "settings": {k: v for k, v in conv.settings.items() if k in KEPT_SETTINGS},
            "messages": [{"role": m.role, "content": m.content, "meta": m.meta}
                         for m in messages]}


def as_markdown(conv: Conversation, messages: list[Message]) -> str:
    """The conversation for people: a heading per speaker, replies as they were written."""
    play = conv.settings.get("play") or {}
    names = {"user": play.get("user") or "You", "assistant": play.get("assistant") or "Assistant",
             "system": "System"}
    out = [f"# {conv.title}\n"]
    if conv.settings.get("system"):
        out.append(f"> **System prompt:** {conv.settings['system']}\n")
    for m in messages:
        out.append(f"## {names.get(m.role, m.role)}\n\n{m.content.strip()}\n")
        stats = (m.meta or {}).get("stats") or {}
        if stats.get("finish_reason") == "length":
            out.append("*(cut at the max-tokens limit)*\n")
    return "\n".join(out)


def parse_import(data: Any) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """(title, settings, messages) from an uploaded export; ValueError naming the problem."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a conversation export: 'format' must be {FORMAT!r}")
    if data.get("version") != VERSION:
        raise ValueError(f"unknown export version {data.get('version')!r} (this app reads "
                         f"{VERSION})")
    title = data.get("title") or "Imported chat"
    settings = data.get("settings") or {}
    messages = data.get("messages")
    if not isinstance(title, str) or not isinstance(settings, dict):
        raise ValueError("'title' must be text and 'settings' an object")
    if not isinstance(messages, list) or len(messages) > MAX_MESSAGES:
        raise ValueError(f"'messages' must be a list of at most {MAX_MESSAGES}")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES \
                or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] needs a role ({', '.join(ROLES)}) and text content")
        if len(m["content"]) > MAX_CHARS:
            raise ValueError(f"messages[{i}] is longer than {MAX_CHARS} characters")
        meta = m.get("meta") if isinstance(m.get("meta"), dict) else {}
        clean.append({"role": m["role"], "content": m["content"], "meta": meta})
    return title[:200], {k: v for k, v in settings.items() if k in KEPT_SETTINGS}, clean


def import_conversation(store: Store, sid: int, data: Any) -> Conversation:
    """A new conversation of session `sid` from an export (validated first)."""
    title, settings, messages = parse_import(data)
    conv = store.create_conversation(sid, title, settings)
    for m in messages:
        store.add_message(sid, conv.id, m["role"], m["content"], m["meta"])
    return conv


def search(store: Store, sid: int, query: str, limit: int = 50) -> list[dict[str, Any]]:
    """The session's conversations whose title or messages contain `query` (any case), most
    recent first, each with a snippet around the first match."""
    needle = query.strip().lower()
    if not needle:
        return []
    found = []
    for conv in store.conversations(sid):
        texts = [conv.title] + [m.content for m in store.messages(sid, conv.id) or []]
        for text in texts:
            at = text.lower().find(needle)
            if at >= 0:
                start = max(0, at - 30)
                snippet = ("…" if start else "") + " ".join(text[start:at + len(needle) + 50]
                                                             .split())
                found.append({"id": conv.id, "title": conv.title, "snippet": snippet})
                break
        if len(found) >= limit:
            break
    return found
