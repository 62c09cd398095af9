"""The chat app's sessions, conversations and messages in SQLite (stdlib `sqlite3`).

One file (by default `~/.cache/llm-stack/chat.db`) holds everything, so conversations
survive a restart of the app. Each browser is a *session*: it holds a random token in a
cookie and the database keeps only the token's SHA-256, so a stolen database file does not
hand out live cookies. Every read or write of a conversation names the session, and a
conversation of another session is reported as missing (`None`), which the web layer turns
into a 404: a client cannot even learn that someone else's id exists.

A session row is written only when the session first writes (its first conversation): a
page load sets the cookie and stores nothing, so visitors who never chat leave no rows.
Every stored field has a size limit (MAX_*; ValueError beyond it), and a reply being
generated is written as it streams (`update_message`), so a crash loses at most the last
second of it.

The schema is versioned: `schema_version` records the version the file is at, and
`Store()` applies the `MIGRATIONS` (store_schema.py) it has not seen yet, in order, inside
one transaction.
"""
from __future__ import annotations

import hashlib
import json
import re
import secrets
import sqlite3
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .store_schema import MIGRATIONS, SCHEMA_VERSION

DEFAULT_DB = Path.home() / ".cache" / "llm-stack" / "chat.db"
ROLES = ("system", "user", "assistant")
MAX_TITLE_CHARS = 200          # longer titles are cut
MAX_CONTENT_CHARS = 200_000    # a message's text
MAX_META_BYTES = 64 * 1024     # a message's metadata, as JSON
MAX_SETTINGS_BYTES = 4 << 20   # a conversation's settings, as JSON (branches live there)
TOKEN = re.compile(r"[A-Za-z0-9_-]{32,64}")  # what new_token makes (secrets.token_urlsafe)


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


def _json(value: dict[str, Any], limit: int, what: str) -> str:
    text = json.dumps(value)
    if len(text.encode()) > limit:
        raise ValueError(f"{what} is {len(text.encode())} bytes as JSON; at most {limit}")
    return text


def _content(content: str) -> str:
    if len(content) > MAX_CONTENT_CHARS:
        raise ValueError(f"a message is at most {MAX_CONTENT_CHARS} characters, "
                         f"got {len(content)}")
    return content


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
    @staticmethod
    def new_token() -> str:
        """A fresh random session token (for the cookie); no row until `ensure_session`."""
        return secrets.token_urlsafe(32)

    def new_session(self) -> tuple[str, int]:
        """A fresh random token (for the cookie) and the session's id (its row written)."""
        token = self.new_token()
        return token, self.ensure_session(token)

    def ensure_session(self, token: str) -> int:
        """The session of a well-formed token, its row written now if it has none yet
        (ValueError for a token new_token could not have made)."""
        if not TOKEN.fullmatch(token or ""):
            raise ValueError("malformed session token")
        with self._db() as db:
            db.execute("INSERT OR IGNORE INTO sessions (token_hash, created_at) VALUES (?, ?)",
                       (_hash(token), time.time()))
            row = db.execute("SELECT id FROM sessions WHERE token_hash = ?",
                             (_hash(token),)).fetchone()
        return int(row[0])

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
        conv = Conversation(uuid.uuid4().hex, title[:MAX_TITLE_CHARS], now, dict(settings or {}))
        text = _json(conv.settings, MAX_SETTINGS_BYTES, "settings")
        with self._db() as db:
            db.execute("INSERT INTO conversations (id, session_id, title, created_at, updated_at,"
                       " settings) VALUES (?, ?, ?, ?, ?, ?)",
                       (conv.id, session, conv.title, now, now, text))
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
            args.append(title[:MAX_TITLE_CHARS])
        if settings is not None:
            sets.append("settings = ?")
            args.append(_json(settings, MAX_SETTINGS_BYTES, "settings"))
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
        meta_text = _json(meta or {}, MAX_META_BYTES, "message metadata")
        if self.conversation(session, conv_id) is None:
            return None
        with self._db() as db:
            cur = db.execute("INSERT INTO messages (conversation_id, role, content, created_at, "
                             "meta) VALUES (?, ?, ?, ?, ?)",
                             (conv_id, role, _content(content), time.time(), meta_text))
            db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?",
                       (time.time(), conv_id))
        return Message(int(cur.lastrowid), role, content, dict(meta or {}))

    def update_message(self, session: int, conv_id: str, message_id: int, content: str,
                       meta: dict[str, Any] | None = None) -> bool:
        """Replace a message's text (and metadata, when given): a reply written as it
        streams. False if the message is not in the session's conversation."""
        meta_text = None if meta is None else _json(meta, MAX_META_BYTES, "message metadata")
        content = _content(content)
        with self._db() as db:
            cur = db.execute(
                "UPDATE messages SET content = ?, meta = COALESCE(?, meta) WHERE id = ? AND "
                "conversation_id = (SELECT id FROM conversations WHERE id = ? AND "
                "session_id = ?)", (content, meta_text, message_id, conv_id, session))
        return cur.rowcount == 1

    def delete_messages_from(self, session: int, conv_id: str, message_id: int) -> bool:
        """Delete message `message_id` and every later one (for Regenerate)."""
        if self.conversation(session, conv_id) is None:
            return False
        with self._db() as db:
            db.execute("DELETE FROM messages WHERE conversation_id = ? AND id >= ?",
                       (conv_id, message_id))
        return True
