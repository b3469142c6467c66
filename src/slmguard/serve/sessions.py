"""Server-side conversation sessions in SQLite: history as the prompt prefix, trim.

Owns the session database (``<state_dir>/sessions.sqlite3``,
:class:`SessionStore`: durable, private, one transaction per call; its rules in
its docstring) and the server's asynchronous use of it (:class:`SessionService`):
appending the messages of a turn, returning the stored history, dropping the
oldest, trimming histories to the most recent N tokens (:func:`plan_trim`). It
does not tokenize (token counts come from a callback the server supplies) and
does not build prompts (the chat dialect's).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slmguard.errors import SessionIdError, SessionStoreError, SessionStoreFullError

log = logging.getLogger(__name__)

#: The one session-id rule (``SessionIdError.RULE`` says it in words); the request
#: schemas document it as :data:`SESSION_ID_PATTERN`.
SESSION_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
SESSION_ID_PATTERN = f"^{SESSION_ID_RE.pattern}$"
SCHEMA_VERSION = 2
FILENAME = "sessions.sqlite3"
# Message keys kept besides role and content (everything a chat turn may carry).
EXTRA_KEYS = ("name", "tool_calls", "tool_call_id", "reasoning_content")

TokenCounter = Callable[[str, str], int]  # (role, content) -> tokens
#: Below this much free space on its filesystem the store takes no new turn: a turn is a
#: few pages of WAL and their checkpoint, and the generation is not run for nothing.
RESERVE_BYTES = 1 << 20
#: A new database's page size. A turn changes a few hundred bytes on each of about four
#: pages (the table, its index, the AUTOINCREMENT sequence) and every commit writes each
#: changed page whole to the WAL: 1 KiB pages write half the bytes of 4 KiB ones for a
#: turn committed alone (``benchmarks/session_writes.py``). Fixed once WAL is entered: an
#: existing database keeps its size.
PAGE_SIZE = 1024
_SQLITE_FULL = 13  # sqlite3.SQLITE_FULL (named from Python 3.11), a primary result code

_INSERT = (
    "INSERT INTO messages (session_id, role, content, extra, tokens, created_s) "
    "VALUES (?, ?, ?, ?, ?, ?)"
)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id TEXT NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    tokens INTEGER,
    created_s REAL NOT NULL,
    extra TEXT
);
CREATE INDEX IF NOT EXISTS messages_by_session ON messages (session_id, id);
"""


def free_bytes(path: Path) -> int | None:
    """Free bytes (for an unprivileged writer) on the filesystem holding ``path``'s
    directory; None when it cannot be read."""
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def store_error(path: Path, err: sqlite3.Error | OSError) -> SessionStoreError:
    """The store's error for a failed SQLite call or file operation: "full" when SQLite
    said SQLITE_FULL, the OS said ENOSPC, or (Python 3.10 has no error code) the
    filesystem has less than :data:`RESERVE_BYTES` free."""
    code = getattr(err, "sqlite_errorcode", None)
    free = free_bytes(path)
    full = (
        (isinstance(code, int) and code & 0xFF == _SQLITE_FULL)
        or getattr(err, "errno", None) == errno.ENOSPC
        or (code is None and free is not None and free < RESERVE_BYTES)
    )
    if full:
        return SessionStoreFullError(path, free)
    if isinstance(err, OSError):
        return SessionStoreError(path, err.strerror or str(err))
    return SessionStoreError(path, str(err))


def check_session_id(session_id: object) -> str:
    """Return ``session_id`` when valid, else raise SessionIdError."""
    if not isinstance(session_id, str) or not SESSION_ID_RE.fullmatch(session_id):
        raise SessionIdError(session_id)
    return session_id


Message = dict[str, Any]  # one chat message as the API carries it


@dataclass(frozen=True)
class StoredMessage:
    role: str
    content: str
    tokens: int | None = None
    extra: str | None = None  # JSON object of EXTRA_KEYS (and "content": null)

    def as_chat(self) -> Message:
        out: Message = {"role": self.role, "content": self.content}
        if self.extra:
            out.update(json.loads(self.extra))
        return out


def _split(message: Mapping[str, Any]) -> tuple[str, str, str | None]:
    """(role, text, extra JSON) of one chat message for storage."""
    content = message.get("content")
    if isinstance(content, list):
        text = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    else:
        text = "" if content is None else str(content)
    extra = {k: message[k] for k in EXTRA_KEYS if message.get(k) is not None}
    if content is None:
        extra["content"] = None
    return str(message["role"]), text, json.dumps(extra, ensure_ascii=False) if extra else None


def _private(path: Path) -> None:
    """Create the database file 0600 (and tighten it and its -wal/-shm if they exist), in
    a directory made 0700 when it is made here (an existing one keeps its mode: it may be
    a shared one the operator chose)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.close(fd)
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(p, 0o600)


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

    Durability: WAL journal with ``synchronous=FULL``, so every committed append
    survives ``kill -9`` of the process and a power cut (WAL + FULL syncs the log
    on each commit; see https://www.sqlite.org/pragma.html#pragma_synchronous).

    Writes are batched (an SD card wears by the block, and consecutive turns land on the
    same pages): the server's turns are kept in memory and committed together, in one
    transaction and one fsync, within ``defer_s`` (2 s) or once ``max_pending_turns`` (32)
    wait; every read sees them (a session's next turn has its history), and whatever else
    writes (a trim, a delete, dropping old turns) commits them first. So a turn is on disk
    within 2 s of its answer: ``kill -9`` or a power cut loses at most those seconds, never
    the database's consistency (the bytes written per turn, alone and batched:
    ``benchmarks/session_writes.py``). A new database has :data:`PAGE_SIZE` pages, so a
    commit writes small pages whole, not 4 KiB ones.

    A full filesystem: below :data:`RESERVE_BYTES` free a new session turn is refused
    before its generation runs (:class:`~slmguard.errors.SessionStoreFullError`, HTTP 507
    ``session_store_full``), and a write that still meets a full disk (SQLITE_FULL) raises
    the same; SQLite rolls the transaction back, so the database stays whole and takes
    turns again once space returns.

    Each public call is one transaction. Calls are blocking; an asyncio server
    runs them in a thread (``asyncio.to_thread``). One store object may be shared
    by threads (one connection behind a lock); several processes may open the same
    file (``busy_timeout`` waits for the other writer).

    Messages keep their whole chat shape: besides role and text, an assistant's
    ``tool_calls``, a tool message's ``tool_call_id``, a ``name`` or
    ``reasoning_content`` are kept as JSON beside the text (schema 2; a schema 1
    database is migrated in place), so tool-call turns replay as they were.

    Privacy: the database holds every prompt and answer. It is created 0600 in a
    0700 directory whatever the umask; SQLite gives its ``-wal`` and ``-shm``
    files the database file's mode, and existing ones are tightened on open.

    Trim rule: system messages are always kept and do not count against N; the
    other messages are kept newest first while their token total stays within N,
    stopping at the first that does not fit (no holes in the conversation); a
    kept history that would then start with an assistant turn loses that turn, so
    chat templates that expect a user turn first still apply.

    Example::

        store = SessionStore.open(state_dir / "sessions.sqlite3")
        store.append("user-42", [{"role": "user", "content": "hi"}], tokens=[3])
        prefix = store.history("user-42")          # list of {"role", "content"}
        store.trim(512, count_tokens=lambda role, text: len(text) // 4)
    """

    def __init__(
        self,
        path: Path,
        conn: sqlite3.Connection,
        *,
        defer_s: float = 2.0,
        max_pending_turns: int = 32,
    ) -> None:
        self.path = path
        self._conn = conn
        self._lock = threading.Lock()
        self.defer_s = defer_s  # a deferred turn is committed within this (the server's timer)
        self.max_pending_turns = max_pending_turns
        self._pending: list[tuple[Any, ...]] = []  # rows of deferred turns, in order
        self._pending_turns = 0

    @classmethod
    def open(cls, path: Path, *, busy_timeout_s: float = 5.0) -> SessionStore:
        try:
            _private(path)
            conn = sqlite3.connect(
                str(path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            conn.execute(f"PRAGMA page_size={PAGE_SIZE}")  # a new database only
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version == 1:
                # Schema 1 had no extra column: tool-call fields were not kept.
                conn.execute("ALTER TABLE messages ADD COLUMN extra TEXT")
            elif version not in (0, SCHEMA_VERSION):
                conn.close()
                raise SessionStoreError(path, f"schema version {version} is not {SCHEMA_VERSION}")
            conn.executescript(_SCHEMA)
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except sqlite3.Error as err:
            found = store_error(path, err)
            if type(found) is SessionStoreError:
                found = SessionStoreError(path, f"cannot open session store: {err}")
            raise found from err
        except OSError as err:
            raise store_error(path, err) from err
        return cls(path, conn)

    def close(self) -> None:
        """Commit the deferred turns (a failure is logged: they are lost) and close."""
        try:
            self.flush()
        except SessionStoreError as err:
            log.error("session store: %d deferred turn(s) not stored: %s", self.pending, err)
        with self._lock:
            self._conn.close()

    @property
    def pending(self) -> int:
        """Deferred turns not committed yet."""
        return self._pending_turns

    def flush(self) -> None:
        """Commit the deferred turns now (one transaction). Raises SessionStoreError (kept
        in memory: tried again by the next write)."""
        if self._pending_turns:
            with self._tx(write=True):
                pass

    @contextmanager
    def _tx(self, write: bool) -> Iterator[sqlite3.Connection]:
        """One transaction under the lock; a write one commits the deferred turns first
        and forgets them once committed."""
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                try:
                    if write and self._pending:
                        self._conn.executemany(_INSERT, self._pending)
                    yield self._conn
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise
                self._conn.execute("COMMIT")
            except sqlite3.Error as err:
                if self._conn.in_transaction:  # a COMMIT that failed (SQLITE_FULL)
                    with contextlib.suppress(sqlite3.Error):
                        self._conn.execute("ROLLBACK")
                raise store_error(self.path, err) from err
            if write:
                self._pending.clear()
                self._pending_turns = 0

    def append(
        self,
        session_id: str,
        messages: Iterable[Mapping[str, Any]],
        *,
        tokens: Iterable[int | None] | None = None,
        defer: bool = False,
    ) -> int:
        """Append chat messages as one turn; returns how many. ``defer``: kept in memory
        and committed with the next write or :meth:`flush` (see the module docstring),
        unless ``max_pending_turns`` already wait: then everything is committed now."""
        check_session_id(session_id)
        msgs = list(messages)
        counts = list(tokens) if tokens is not None else [None] * len(msgs)
        if len(counts) != len(msgs):
            raise ValueError("tokens must have one entry per message")
        now = time.time()
        rows = [(session_id, *_split(m), t, now) for m, t in zip(msgs, counts, strict=True)]
        with self._lock:
            if defer and self._pending_turns < self.max_pending_turns:
                self._pending.extend(rows)
                self._pending_turns += 1
                return len(rows)
        with self._tx(write=True) as conn:
            conn.executemany(_INSERT, rows)
        return len(rows)

    def messages(self, session_id: str) -> list[StoredMessage]:
        """The session's messages, the deferred ones included, in order."""
        check_session_id(session_id)
        with self._tx(write=False) as conn:
            rows = conn.execute(
                "SELECT role, content, tokens, extra FROM messages WHERE session_id = ? "
                "ORDER BY id",
                (session_id,),
            ).fetchall()
            rows += [(r[1], r[2], r[4], r[3]) for r in self._pending if r[0] == session_id]
        return [StoredMessage(r, c, t, x) for r, c, t, x in rows]

    def history(self, session_id: str) -> list[Message]:
        """The stored conversation as chat messages: the prompt prefix of the next turn."""
        return [m.as_chat() for m in self.messages(session_id)]

    def sessions(self) -> list[str]:
        with self._tx(write=False) as conn:
            rows = conn.execute("SELECT DISTINCT session_id FROM messages ORDER BY session_id")
            found = {r[0] for r in rows.fetchall()} | {r[0] for r in self._pending}
        return sorted(found)

    def delete(self, session_id: str) -> int:
        check_session_id(session_id)
        with self._tx(write=True) as conn:
            return conn.execute("DELETE FROM messages WHERE session_id = ?", (session_id,)).rowcount

    def drop_oldest(self, session_id: str, n_messages: int) -> int:
        """Delete the oldest ``n_messages`` non-system messages of a session; returns how many."""
        check_session_id(session_id)
        if n_messages <= 0:
            return 0
        with self._tx(write=True) as conn:
            ids = conn.execute(
                "SELECT id FROM messages WHERE session_id = ? AND role != 'system' "
                "ORDER BY id LIMIT ?",
                (session_id, n_messages),
            ).fetchall()
            conn.executemany("DELETE FROM messages WHERE id = ?", ids)
        return len(ids)

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


class SessionService:
    """The server's use of the store, for a running event loop (blocking calls in a thread).

    Example::

        sessions = SessionService(SessionStore.open(state_dir / FILENAME))
        prompt = await sessions.session_prompt("user-42", [{"role": "user", "content": "hi"}])
    """

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._flush_timer: asyncio.TimerHandle | None = None
        self._flush_task: asyncio.Task[None] | None = None  # the timer's, kept referenced

    async def session_prompt(self, session_id: str, new_messages: list[Message]) -> list[Message]:
        """The stored history of ``session_id`` followed by ``new_messages``.

        A system message in ``new_messages`` replaces the stored ones (a client
        that re-sends its system prompt each turn must not stack them).
        """
        import asyncio

        self.check_room()
        history = await asyncio.to_thread(self.store.history, session_id)
        if any(m.get("role") == "system" for m in new_messages):
            history = [m for m in history if m["role"] != "system"]
        return history + list(new_messages)

    def check_room(self) -> None:
        """Raise SessionStoreFullError (507) when the store's filesystem has less than
        :data:`RESERVE_BYTES` free: the turn would run and not be stored."""
        free = free_bytes(self.store.path)
        if free is not None and free < RESERVE_BYTES:
            raise SessionStoreFullError(self.store.path, free)

    async def record_turn(
        self,
        session_id: str,
        new_messages: list[Message],
        answer: Message,
        *,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        """Store one finished turn: the new messages and the answer, with token counts.

        The engine reports tokens per request, not per message: the new
        messages share ``prompt_tokens`` minus what the stored history already
        counts (template tokens included), in proportion to their length.
        """
        import asyncio

        store = self.store

        def write() -> None:
            stored = store.messages(session_id)
            systems = {m.content for m in stored if m.role == "system"}
            fresh_msgs = [
                m for m in new_messages if m.get("role") != "system" or _text(m) not in systems
            ]
            known = sum(
                m.tokens if m.tokens is not None else len(m.content) // 4 + 1 for m in stored
            )
            fresh = max(len(fresh_msgs), prompt_tokens - known)
            chars = [max(1, len(_text(m))) for m in fresh_msgs]
            shares = [max(1, fresh * c // sum(chars)) for c in chars] if chars else []
            store.append(
                session_id,
                [*fresh_msgs, answer],
                tokens=[*shares, max(1, completion_tokens)],
                defer=True,
            )

        await asyncio.to_thread(write)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        """Commit the deferred turns ``defer_s`` from now (once; again while they fail)."""
        import asyncio

        if self._flush_timer is not None or not self.store.pending:
            return
        loop = asyncio.get_running_loop()

        def due() -> None:
            self._flush_task = loop.create_task(self._flush())

        self._flush_timer = loop.call_later(self.store.defer_s, due)

    async def _flush(self) -> None:
        import asyncio

        self._flush_timer = None
        try:
            await asyncio.to_thread(self.store.flush)
        except SessionStoreError as err:
            log.error("session store: %d turn(s) kept in memory, not stored yet: %s",
                      self.store.pending, err)  # fmt: skip
        self._schedule_flush()

    async def drop_oldest(self, session_id: str, n_messages: int) -> int:
        import asyncio

        return await asyncio.to_thread(self.store.drop_oldest, session_id, n_messages)

    async def delete(self, session_id: str) -> int:
        import asyncio

        return await asyncio.to_thread(self.store.delete, session_id)

    def close(self) -> None:
        """Commit what is deferred and close (the server's last step)."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        self.store.close()


def _text(message: Mapping[str, Any]) -> str:
    return _split(message)[1]
