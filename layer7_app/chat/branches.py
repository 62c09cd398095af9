"""Branches of a conversation: editing a sent message (or regenerating a reply) keeps what
was there as another branch, and any branch can be brought back.

The store keeps one line of messages, the branch on screen. The others live in the
conversation's settings, under "branches": for a position p (the index of the message that
was edited or regenerated), `{"variants": [...], "live": k}` where variant k is the one in
the message table (its slot is None) and every other slot holds a snapshot of the line from
p on: its messages and the branch points further down it. Switching to variant j
snapshots the live tail into slot k and writes snapshot j back as messages.
"""
from __future__ import annotations

from typing import Any

from ..store import Message, Store

MAX_VARIANTS = 20  # per position: a page of arrows, not an archive


def branch_points(settings: dict[str, Any]) -> list[dict[str, int]]:
    """What the page draws: [{"position", "count", "live"}] for each branch point."""
    points = settings.get("branches") or {}
    return [{"position": int(p), "count": len(b["variants"]), "live": int(b["live"])}
            for p, b in sorted(points.items(), key=lambda kv: int(kv[0]))]


def _snapshot(tail: list[Message], branches: dict[str, Any], position: int) -> dict[str, Any]:
    """The line from `position` on, with the branch points below it (removed from `branches`)."""
    deeper = {p: branches.pop(p) for p in list(branches) if int(p) > position}
    return {"messages": [{"role": m.role, "content": m.content, "meta": m.meta} for m in tail],
            "branches": deeper}


def _restore(store: Store, sid: int, conv_id: str, snap: dict[str, Any],
             branches: dict[str, Any]) -> None:
    for m in snap["messages"]:
        store.add_message(sid, conv_id, m["role"], m["content"], m.get("meta") or {})
    branches.update(snap.get("branches") or {})


def fork(store: Store, sid: int, conv_id: str, position: int) -> dict[str, Any]:
    """Keep the line from `position` on as a branch, delete it from the messages, and make
    room for a new variant there (which the caller then writes). Returns the new settings."""
    conv = store.conversation(sid, conv_id)
    messages = store.messages(sid, conv_id)
    if conv is None or messages is None:
        raise LookupError("no such conversation")
    if not 0 <= position < len(messages):
        raise ValueError(f"no message at position {position}")
    settings = dict(conv.settings)
    branches = dict(settings.get("branches") or {})
    point = branches.get(str(position)) or {"variants": [None], "live": 0}
    if len(point["variants"]) >= MAX_VARIANTS:
        raise ValueError(f"at most {MAX_VARIANTS} branches at one message")
    point["variants"][point["live"]] = _snapshot(messages[position:], branches, position)
    point["variants"].append(None)
    point["live"] = len(point["variants"]) - 1
    branches[str(position)] = point
    store.delete_messages_from(sid, conv_id, messages[position].id)
    settings["branches"] = branches
    store.update_conversation(sid, conv_id, settings=settings)
    return settings


def switch(store: Store, sid: int, conv_id: str, position: int, variant: int) -> None:
    """Bring branch `variant` at `position` back; the one shown until now is kept."""
    conv = store.conversation(sid, conv_id)
    messages = store.messages(sid, conv_id)
    if conv is None or messages is None:
        raise LookupError("no such conversation")
    settings = dict(conv.settings)
    branches = dict(settings.get("branches") or {})
    point = branches.get(str(position))
    if point is None or not 0 <= variant < len(point["variants"]):
        raise ValueError(f"no branch {variant} at position {position}")
    if variant == point["live"]:
        return
    point["variants"][point["live"]] = _snapshot(messages[position:], branches, position)
    if position < len(messages):
        store.delete_messages_from(sid, conv_id, messages[position].id)
    snap, point["variants"][variant] = point["variants"][variant], None
    point["live"] = variant
    _restore(store, sid, conv_id, snap, branches)
    settings["branches"] = branches
    store.update_conversation(sid, conv_id, settings=settings)
