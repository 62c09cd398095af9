"""The SQLite store: persistence across reopen, session isolation, schema migration."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from layer7_app.store import MIGRATIONS, SCHEMA_VERSION, Store


def test_conversations_survive_reopening(tmp_path: Path) -> None:
    db = tmp_path / "chat.db"
    store = Store(db)
    token, sid = store.new_session()
    conv = store.create_conversation(sid, "first", {"model": "course"})
    store.add_message(sid, conv.id, "user", "What news?")
    store.add_message(sid, conv.id, "assistant", "None, my lord.", {"stopped": False})

    again = Store(db)  # as after a restart
    assert again.session_id(token) == sid
    assert [c.title for c in again.conversations(sid)] == ["first"]
    assert again.conversation(sid, conv.id).settings == {"model": "course"}
    msgs = again.messages(sid, conv.id)
    assert [(m.role, m.content) for m in msgs] == [("user", "What news?"),
                                                  ("assistant", "None, my lord.")]
    assert msgs[1].meta == {"stopped": False}


def test_a_session_cannot_touch_another_sessions_conversations(tmp_path: Path) -> None:
    store = Store(tmp_path / "chat.db")
    _, alice = store.new_session()
    _, bob = store.new_session()
    conv = store.create_conversation(alice, "private")
    store.add_message(alice, conv.id, "user", "secret")
    assert store.conversations(bob) == []
    assert store.conversation(bob, conv.id) is None
    assert store.messages(bob, conv.id) is None
    assert store.add_message(bob, conv.id, "user", "intrusion") is None
    assert not store.update_conversation(bob, conv.id, title="mine now")
    assert not store.delete_messages_from(bob, conv.id, 0)
    assert not store.delete_conversation(bob, conv.id)
    assert [m.content for m in store.messages(alice, conv.id)] == ["secret"]
    assert store.conversation(alice, conv.id).title == "private"


def test_tokens_are_stored_hashed_and_unknown_tokens_have_no_session(tmp_path: Path) -> None:
    store = Store(tmp_path / "chat.db")
    token, _ = store.new_session()
    with sqlite3.connect(store.path) as conn:
        stored = [r[0] for r in conn.execute("SELECT token_hash FROM sessions")]
    assert token not in stored and len(stored) == 1
    assert store.session_id("not-a-token") is None and store.session_id(None) is None


def test_regenerate_deletes_from_a_message_on(tmp_path: Path) -> None:
    store = Store(tmp_path / "chat.db")
    _, sid = store.new_session()
    conv = store.create_conversation(sid)
    ids = [store.add_message(sid, conv.id, r, c).id
           for r, c in (("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"))]
    assert store.delete_messages_from(sid, conv.id, ids[3])
    assert [m.content for m in store.messages(sid, conv.id)] == ["a", "b", "c"]


def test_migration_from_version_1_keeps_the_data(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    with sqlite3.connect(db) as conn:  # a file written by version 1 of the schema
        conn.executescript(MIGRATIONS[0])
        conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO schema_version VALUES (1)")
        conn.execute("INSERT INTO sessions VALUES (1, 'h', 0)")
        conn.execute("INSERT INTO conversations VALUES ('c1', 1, 'old chat', 0, 0)")
        conn.execute("INSERT INTO messages VALUES (1, 'c1', 'user', 'hello', 0)")
    store = Store(db)
    assert store.version() == SCHEMA_VERSION == 2
    assert store.conversation(1, "c1").settings == {}
    assert [(m.content, m.meta) for m in store.messages(1, "c1")] == [("hello", {})]


def test_a_newer_schema_or_a_bad_path_is_a_clear_error(tmp_path: Path) -> None:
    db = tmp_path / "new.db"
    Store(db)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE schema_version SET version = 99")
    with pytest.raises(ValueError, match="newer"):
        Store(db)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cannot open"):
        Store(tmp_path / "file" / "chat.db")
    with pytest.raises(ValueError, match="role"):
        store = Store(tmp_path / "ok.db")
        _, sid = store.new_session()
        store.add_message(sid, store.create_conversation(sid).id, "tool", "x")
