"""The chat store's SQLite schema, as the migrations that build it (store.py applies them).

Version N is reached by running MIGRATIONS[N - 1]; `schema_version` in the file says which
it has run. Append, never edit: a file in the wild may be at any earlier version.
"""
from __future__ import annotations

MIGRATIONS: tuple[str, ...] = (
    # 1: sessions, conversations, messages.
    """
    CREATE TABLE sessions (
        id INTEGER PRIMARY KEY,
        token_hash TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL
    );
    CREATE TABLE conversations (
        id TEXT PRIMARY KEY,
        session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
        title TEXT NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    -- the two lists the page reads: a session's conversations by last update, and a
    -- conversation's messages in order
    CREATE INDEX conversations_by_session ON conversations(session_id, updated_at);
    CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
    """,
    # 2: per-conversation settings (model, temperature, play-mode names) and per-message
    # metadata (stats, citations, whether the reply was stopped), both as JSON text.
    """
    ALTER TABLE conversations ADD COLUMN settings TEXT NOT NULL DEFAULT '{}';
    ALTER TABLE messages ADD COLUMN meta TEXT NOT NULL DEFAULT '{}';
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)
