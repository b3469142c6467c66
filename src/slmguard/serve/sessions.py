"""Server-side conversation sessions in SQLite: history as the prompt prefix, trim.

Owns the session database (``<state_dir>/sessions.sqlite3``): appending the
messages of a turn, returning the stored history, and trimming histories to
the most recent N tokens. It does not tokenize (token counts come from a
callback the server supplies) and does not build prompts.

Durability: WAL journal with ``synchronous=FULL``, so every committed append
survives ``kill -9`` of the process and a power cut (WAL + FULL syncs the log
on each commit; see https://www.sqlite.org/pragma.html#pragma_synchronous).
Each public call is one transaction. Calls are blocking; an asyncio server
runs them in a thread (``asyncio.to_thread``). One store object may be shared
by threads (one connection behind a lock); several processes may open the same
file (``busy_timeout`` waits for the other writer).

Trim rule: system messages are always kept and do not count against N; the
other messages are kept newest first while their token total stays within N,
stopping at the first that does not fit (no holes in the conversation); a
kept history that would then start with an assistant turn loses that turn, so
chat templates that expect a user turn first still apply.
"""

from __future__ import annotations

import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import SessionIdError, SessionStoreError

SESSION_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
SCHEMA_VERSION = 1
FILENAME = "sessions.sqlite3"

TokenCounter = Callable[[str, str], int]  # (role, content) -> tokens

_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id TEXT NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    tokens INTEGER,
    created_s REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_session ON messages (session_id, id);
"""


def check_session_id(session_id: object) -> str:
    """Return ``session_id`` when valid, else raise SessionIdError."""
    if not isinstance(session_id, str) or not SESSION_ID_RE.fullmatch(session_id):
        raise SessionIdError(session_id)
    return session_id


@dataclass(frozen=True)
class StoredMessage:
    role: str
    content: str
    tokens: int | None = None

    def as_chat(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class TrimResult:
    """What a trim removed (and kept), summed over the sessions it looked at."""

    sessions_seen: int
    sessions_trimmed: int
    messages_removed: int
    tokens_removed: int
    tokens_kept: int

    def as_dict(self) -> dict[str, int]:
        return {
            "sessions_seen": self.sessions_seen,
            "sessions_trimmed": self.sessions_trimmed,
            "messages_removed": self.messages_removed,
            "tokens_removed": self.tokens_removed,
            "tokens_kept": self.tokens_kept,
        }


def plan_trim(
    rows: list[tuple[int, str, int]], keep_recent_tokens: int
) -> tuple[list[int], int, int]:
    """Pure trim decision on ``(id, role, tokens)`` rows in conversation order.

    Returns (ids to delete, tokens removed, tokens kept), by the rule in the
    module docstring.
    """
    keep: set[int] = {rid for rid, role, _ in rows if role == "system"}
    budget = keep_recent_tokens
    kept_turns: list[tuple[int, str]] = []
    for rid, role, tokens in reversed(rows):
        if role == "system":
            continue
        if tokens > budget:
            break
        budget -= tokens
        kept_turns.append((rid, role))
    kept_turns.reverse()
    while kept_turns and kept_turns[0][1] == "assistant":
        kept_turns.pop(0)
    keep.update(rid for rid, _ in kept_turns)
    drop = [rid for rid, _, _ in rows if rid not in keep]
    removed = sum(t for rid, _, t in rows if rid not in keep)
    kept = sum(t for rid, _, t in rows if rid in keep)
    return drop, removed, kept


class SessionStore:
    """The session database. Open with :meth:`open`; close with :meth:`close`.

    Example::

        store = SessionStore.open(state_dir / "sessions.sqlite3")
        store.append("user-42", [{"role": "user", "content": "hi"}], tokens=[3])
        prefix = store.history("user-42")          # list of {"role", "content"}
        store.trim(512, count_tokens=lambda role, text: len(text) // 4)
    """

    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        self.path = path
        self._conn = conn
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: Path, *, busy_timeout_s: float = 5.0) -> SessionStore:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(
                str(path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.executescript(_SCHEMA)
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version == 0:
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            elif version != SCHEMA_VERSION:
                conn.close()
                raise SessionStoreError(path, f"schema version {version} is not {SCHEMA_VERSION}")
        except sqlite3.Error as err:
            raise SessionStoreError(path, f"cannot open session store: {err}") from err
        except OSError as err:
            raise SessionStoreError(path, err.strerror or str(err)) from err
        return cls(path, conn)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def _tx(self, write: bool) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                try:
                    yield self._conn
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise
                self._conn.execute("COMMIT")
            except sqlite3.Error as err:
                raise SessionStoreError(self.path, str(err)) from err

    def append(
        self,
        session_id: str,
        messages: Iterable[Mapping[str, str]],
        *,
        tokens: Iterable[int | None] | None = None,
    ) -> int:
        """Append messages (``{"role", "content"}``) in one transaction; returns how many."""
        check_session_id(session_id)
        msgs = list(messages)
        counts = list(tokens) if tokens is not None else [None] * len(msgs)
        if len(counts) != len(msgs):
            raise ValueError("tokens must have one entry per message")
        now = time.time()
        rows = [
            (session_id, m["role"], m["content"], t, now) for m, t in zip(msgs, counts, strict=True)
        ]
        with self._tx(write=True) as conn:
            conn.executemany(
                "INSERT INTO messages (session_id, role, content, tokens, created_s) "
                "VALUES (?, ?, ?, ?, ?)",
                rows,
            )
        return len(rows)

    def messages(self, session_id: str) -> list[StoredMessage]:
        check_session_id(session_id)
        with self._tx(write=False) as conn:
            rows = conn.execute(
                "SELECT role, content, tokens FROM messages WHERE session_id = ? ORDER BY id",
                (session_id,),
            ).fetchall()
        return [StoredMessage(r, c, t) for r, c, t in rows]

    def history(self, session_id: str) -> list[dict[str, str]]:
        """The stored conversation as chat messages: the prompt prefix of the next turn."""
        return [m.as_chat() for m in self.messages(session_id)]

    def sessions(self) -> list[str]:
        with self._tx(write=False) as conn:
            rows = conn.execute("SELECT DISTINCT session_id FROM messages ORDER BY session_id")
            return [r[0] for r in rows.fetchall()]

    def delete(self, session_id: str) -> int:
        check_session_id(session_id)
        with self._tx(write=True) as conn:
            return conn.execute("DELETE FROM messages WHERE session_id = ?", (session_id,)).rowcount

    def trim(
        self,
        keep_recent_tokens: int,
        *,
        session_id: str | None = None,
        count_tokens: TokenCounter | None = None,
    ) -> TrimResult:
        """Trim one session (or all) to the most recent ``keep_recent_tokens`` tokens.

        Rows stored without a token count are counted with ``count_tokens``
        (and the count is stored); without a callback such rows count as
        ``len(content) // 4 + 1``, a rough upper bound for BPE vocabularies.
        """
        if keep_recent_tokens < 0:
            raise ValueError("keep_recent_tokens must be >= 0")
        if session_id is not None:
            check_session_id(session_id)
        seen = trimmed = removed_msgs = removed_tokens = kept_tokens = 0
        with self._tx(write=True) as conn:
            if session_id is None:
                ids = [r[0] for r in conn.execute("SELECT DISTINCT session_id FROM messages")]
            else:
                ids = [session_id]
            for sid in ids:
                raw = conn.execute(
                    "SELECT id, role, content, tokens FROM messages WHERE session_id = ? "
                    "ORDER BY id",
                    (sid,),
                ).fetchall()
                if not raw:
                    continue
                seen += 1
                rows: list[tuple[int, str, int]] = []
                for rid, role, content, tokens in raw:
                    if tokens is None:
                        tokens = (
                            count_tokens(role, content)
                            if count_tokens is not None
                            else len(content) // 4 + 1
                        )
                        if count_tokens is not None:
                            conn.execute(
                                "UPDATE messages SET tokens = ? WHERE id = ?", (tokens, rid)
                            )
                    rows.append((rid, role, int(tokens)))
                drop, gone, kept = plan_trim(rows, keep_recent_tokens)
                kept_tokens += kept
                if drop:
                    trimmed += 1
                    removed_msgs += len(drop)
                    removed_tokens += gone
                    conn.executemany("DELETE FROM messages WHERE id = ?", [(d,) for d in drop])
        return TrimResult(seen, trimmed, removed_msgs, removed_tokens, kept_tokens)

    def integrity_ok(self) -> bool:
        with self._tx(write=False) as conn:
            return bool(conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok")
