"""The chat app's sessions, conversations and messages in SQLite (stdlib `sqlite3`).

One file (by default `~/.cache/llm-stack/chat.db`) holds everything, so conversations
survive a restart of the app. Each browser is a *session*: it holds a random token in a
cookie and the database keeps only the token's SHA-256, so a stolen database file does not
hand out live cookies. Every read or write of a conversation names the session, and a
conversation of another session is reported as missing (`None`), which the web layer turns
into a 404: a client cannot even learn that someone else's id exists.

The schema is versioned: `schema_version` records the version the file is at, and
`Store()` applies the `MIGRATIONS` it has not seen yet, in order, inside one transaction.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_DB = Path.home() / ".cache" / "llm-stack" / "chat.db"
ROLES = ("system", "user", "assistant")

# Version N is reached by running MIGRATIONS[N - 1]. Append, never edit: a file in the wild
# may be at any earlier version.
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
    CREATE INDEX conversations_by_session ON conversations(session_id, updated_at);
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        created_at REAL NOT NULL
    );
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


@dataclass
class Message:
    """One message of a conversation; `meta` holds stats and citations of a reply."""

    id: int
    role: str
    content: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Conversation:
    """A conversation's header (messages are read separately)."""

    id: str
    title: str
    updated_at: float
    settings: dict[str, Any] = field(default_factory=dict)


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Store:
    """Sessions, conversations and messages in one SQLite file (created and migrated here)."""

    def __init__(self, path: Path | str = DEFAULT_DB) -> None:
        self.path = Path(path).expanduser()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.migrate()
        except (OSError, sqlite3.Error) as exc:
            raise ValueError(f"cannot open the chat database {self.path}: {exc}") from exc

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        # A connection per call: the web app calls from several threads, and SQLite
        # connections are cheap. `with conn` commits, or rolls back on an exception.
        conn = sqlite3.connect(self.path, timeout=10)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA foreign_keys = ON")
        try:
            with conn:
                yield conn
        finally:
            conn.close()

    def version(self) -> int:
        """The schema version the file is at (0 for a new file)."""
        with self._db() as db:
            has = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'schema_version'").fetchone()
            if not has:
                return 0
            row = db.execute("SELECT version FROM schema_version").fetchone()
            return int(row[0]) if row else 0

    def migrate(self) -> int:
        """Bring the file to SCHEMA_VERSION; returns the version it was at before."""
        before = self.version()
        if before > SCHEMA_VERSION:
            raise ValueError(f"schema version {before} is newer than this code knows "
                             f"({SCHEMA_VERSION}); upgrade llm-stack")
        conn = sqlite3.connect(self.path, timeout=10)
        try:
            conn.execute("PRAGMA journal_mode = WAL")  # readers do not block the writer
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            conn.commit()
            # One transaction per step (executescript runs the BEGIN/COMMIT we write), so a
            # failing migration leaves the file at the previous version, never half-way.
            for version in range(before + 1, SCHEMA_VERSION + 1):
                conn.executescript(f"BEGIN; {MIGRATIONS[version - 1]}; "
                                   f"DELETE FROM schema_version; "
                                   f"INSERT INTO schema_version VALUES ({version}); COMMIT;")
        finally:
            conn.close()
        return before

    # ---- sessions ---------------------------------------------------------------------
    def new_session(self) -> tuple[str, int]:
        """A fresh random token (for the cookie) and the session's id."""
        token = secrets.token_urlsafe(32)
        with self._db() as db:
            cur = db.execute("INSERT INTO sessions (token_hash, created_at) VALUES (?, ?)",
                             (_hash(token), time.time()))
        return token, int(cur.lastrowid)

    def session_id(self, token: str | None) -> int | None:
        """The session a cookie token belongs to, or None if it is unknown."""
        if not token:
            return None
        with self._db() as db:
            row = db.execute("SELECT id FROM sessions WHERE token_hash = ?",
                             (_hash(token),)).fetchone()
        return int(row[0]) if row else None

    # ---- conversations ----------------------------------------------------------------
    def create_conversation(self, session: int, title: str = "New chat",
                            settings: dict[str, Any] | None = None) -> Conversation:
        """A new, empty conversation owned by `session`."""
        now = time.time()
        conv = Conversation(uuid.uuid4().hex, title[:200], now, dict(settings or {}))
        with self._db() as db:
            db.execute("INSERT INTO conversations (id, session_id, title, created_at, updated_at,"
                       " settings) VALUES (?, ?, ?, ?, ?, ?)",
                       (conv.id, session, conv.title, now, now, json.dumps(conv.settings)))
        return conv

    def conversations(self, session: int) -> list[Conversation]:
        """The session's conversations, most recently updated first."""
        with self._db() as db:
            rows = db.execute("SELECT id, title, updated_at, settings FROM conversations "
                              "WHERE session_id = ? ORDER BY updated_at DESC",
                              (session,)).fetchall()
        return [Conversation(r["id"], r["title"], r["updated_at"], json.loads(r["settings"]))
                for r in rows]

    def conversation(self, session: int, conv_id: str) -> Conversation | None:
        """One conversation, or None if it does not exist *or belongs to another session*."""
        with self._db() as db:
            r = db.execute("SELECT id, title, updated_at, settings FROM conversations "
                           "WHERE id = ? AND session_id = ?", (conv_id, session)).fetchone()
        return Conversation(r["id"], r["title"], r["updated_at"], json.loads(r["settings"])) \
            if r else None

    def update_conversation(self, session: int, conv_id: str, *, title: str | None = None,
                            settings: dict[str, Any] | None = None) -> bool:
        """Rename and/or replace settings; False if the conversation is not the session's."""
        sets, args = ["updated_at = ?"], [time.time()]
        if title is not None:
            sets.append("title = ?")
            args.append(title[:200])
        if settings is not None:
            sets.append("settings = ?")
            args.append(json.dumps(settings))
        with self._db() as db:
            cur = db.execute(f"UPDATE conversations SET {', '.join(sets)} "
                             "WHERE id = ? AND session_id = ?", (*args, conv_id, session))
        return cur.rowcount == 1

    def delete_conversation(self, session: int, conv_id: str) -> bool:
        """Delete a conversation and its messages; False if it is not the session's."""
        with self._db() as db:
            cur = db.execute("DELETE FROM conversations WHERE id = ? AND session_id = ?",
                             (conv_id, session))
        return cur.rowcount == 1

    # ---- messages ---------------------------------------------------------------------
    def messages(self, session: int, conv_id: str) -> list[Message] | None:
        """The conversation's messages in order, or None if it is not the session's."""
        if self.conversation(session, conv_id) is None:
            return None
        with self._db() as db:
            rows = db.execute("SELECT id, role, content, meta FROM messages "
                              "WHERE conversation_id = ? ORDER BY id", (conv_id,)).fetchall()
        return [Message(r["id"], r["role"], r["content"], json.loads(r["meta"])) for r in rows]

    def add_message(self, session: int, conv_id: str, role: str, content: str,
                    meta: dict[str, Any] | None = None) -> Message | None:
        """Append a message; None if the conversation is not the session's."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if self.conversation(session, conv_id) is None:
            return None
        with self._db() as db:
            cur = db.execute("INSERT INTO messages (conversation_id, role, content, created_at, "
                             "meta) VALUES (?, ?, ?, ?, ?)",
                             (conv_id, role, content, time.time(), json.dumps(meta or {})))
            db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?",
                       (time.time(), conv_id))
        return Message(int(cur.lastrowid), role, content, dict(meta or {}))

    def delete_messages_from(self, session: int, conv_id: str, message_id: int) -> bool:
        """Delete message `message_id` and every later one (for Regenerate)."""
        if self.conversation(session, conv_id) is None:
            return False
        with self._db() as db:
            db.execute("DELETE FROM messages WHERE conversation_id = ? AND id >= ?",
                       (conv_id, message_id))
        return True
