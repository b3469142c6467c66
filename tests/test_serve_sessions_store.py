"""Governor session store: append, history, trim rules, validation, durability across kill -9."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from slmguard.errors import SessionIdError, SessionStoreError
from slmguard.serve.sessions import PAGE_SIZE, SessionStore, check_session_id, plan_trim


@pytest.fixture
def store(tmp_path: Path) -> SessionStore:
    s = SessionStore.open(tmp_path / "state" / "sessions.sqlite3")
    yield s  # type: ignore[misc]
    s.close()


def words(n: int) -> str:
    return " ".join(["w"] * n)


def count_words(role: str, content: str) -> int:
    return len(content.split())


def test_append_and_history_in_order(store: SessionStore) -> None:
    store.append(
        "a", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    store.append("a", [{"role": "assistant", "content": "hello"}], tokens=[2])
    store.append("b", [{"role": "user", "content": "other"}])
    assert store.history("a") == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    assert [m.tokens for m in store.messages("a")] == [None, None, 2]
    assert store.sessions() == ["a", "b"]
    assert store.history("nobody") == []
    assert store.delete("b") == 1
    assert store.sessions() == ["a"]


def test_wal_and_full_sync_are_on(store: SessionStore) -> None:
    conn = sqlite3.connect(str(store.path))
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()
    # synchronous is per connection: check the store's own (2 = FULL).
    assert store._conn.execute("PRAGMA synchronous").fetchone()[0] == 2


@pytest.mark.parametrize(
    ("rows", "keep", "dropped", "removed", "kept"),
    [
        # (id, role, tokens): system always kept and free; newest turns within budget.
        (
            [(1, "system", 50), (2, "user", 10), (3, "assistant", 10), (4, "user", 10)],
            20,
            [2, 3],
            20,
            60,
        ),
        (
            [(1, "system", 50), (2, "user", 10), (3, "assistant", 10), (4, "user", 10)],
            30,
            [],
            0,
            80,
        ),
        # No holes: a big middle turn stops the walk even if older ones would fit.
        ([(1, "user", 1), (2, "assistant", 100), (3, "user", 5)], 50, [1, 2], 101, 5),
        # A kept history must not start with an assistant turn.
        (
            [(1, "user", 10), (2, "assistant", 10), (3, "user", 10), (4, "assistant", 10)],
            30,
            [1, 2],
            20,
            20,
        ),
        # keep 0: only the system message stays.
        ([(1, "system", 5), (2, "user", 1)], 0, [2], 1, 5),
        # The newest turn alone exceeds the budget: nothing but system stays.
        ([(1, "system", 5), (2, "user", 99)], 50, [2], 99, 5),
    ],
)
def test_plan_trim_table(
    rows: list[tuple[int, str, int]], keep: int, dropped: list[int], removed: int, kept: int
) -> None:
    assert plan_trim(rows, keep) == (dropped, removed, kept)


def test_trim_one_session_keeps_system_and_recent(store: SessionStore) -> None:
    turns = [{"role": "system", "content": words(20)}]
    for i in range(6):
        turns.append({"role": "user" if i % 2 == 0 else "assistant", "content": words(10)})
    store.append("long", turns)
    store.append("other", [{"role": "user", "content": words(100)}])
    result = store.trim(25, session_id="long", count_tokens=count_words)
    assert result.as_dict() == {
        "sessions_seen": 1,
        "sessions_trimmed": 1,
        "messages_removed": 4,  # the newest 2 turns (20 tokens) fit in 25
        "tokens_removed": 40,
        "tokens_kept": 40,  # system 20 + the 2 kept turns
    }
    assert [m["role"] for m in store.history("long")] == ["system", "user", "assistant"]
    # Counts computed by the callback were stored.
    assert all(m.tokens is not None for m in store.messages("long"))
    # The other session was not touched.
    assert store.history("other") == [{"role": "user", "content": words(100)}]


def test_trim_all_sessions_and_idempotence(store: SessionStore) -> None:
    for sid in ("s1", "s2", "s3"):
        store.append(
            sid,
            [
                {"role": "user", "content": words(30)},
                {"role": "assistant", "content": words(30)},
                {"role": "user", "content": words(5)},
            ],
        )
    first = store.trim(10, count_tokens=count_words)
    assert (first.sessions_seen, first.sessions_trimmed, first.messages_removed) == (3, 3, 6)
    assert first.tokens_removed == 180 and first.tokens_kept == 15
    again = store.trim(10, count_tokens=count_words)
    assert (again.sessions_trimmed, again.messages_removed, again.tokens_kept) == (0, 0, 15)


def test_trim_without_counter_uses_the_stored_or_rough_count(store: SessionStore) -> None:
    store.append(
        "s",
        [{"role": "user", "content": "x" * 400}, {"role": "user", "content": "y"}],
        tokens=[None, 1],
    )
    result = store.trim(50)  # 400 chars ~ 101 tokens by the rough bound: dropped
    assert result.messages_removed == 1
    assert store.history("s") == [{"role": "user", "content": "y"}]


@pytest.mark.parametrize("bad", ["", "a" * 129, "a b", "a/b", "é", None, 5])
def test_invalid_session_ids_are_refused(store: SessionStore, bad: object) -> None:
    with pytest.raises(SessionIdError):
        check_session_id(bad)
    with pytest.raises(SessionIdError):
        store.append(bad, [{"role": "user", "content": "x"}])  # type: ignore[arg-type]
    if bad is not None:  # None means "every session" for trim
        with pytest.raises(SessionIdError):
            store.trim(10, session_id=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("good", ["a", "user-42", "tenant:7.chat_1", "A" * 128])
def test_valid_session_ids(good: str) -> None:
    assert check_session_id(good) == good


def test_bad_arguments(store: SessionStore) -> None:
    with pytest.raises(ValueError):
        store.trim(-1)
    with pytest.raises(ValueError):
        store.append("s", [{"role": "user", "content": "x"}], tokens=[1, 2])


def test_not_a_database_is_a_store_error(tmp_path: Path) -> None:
    path = tmp_path / "sessions.sqlite3"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(SessionStoreError) as info:
        SessionStore.open(path)
    assert info.value.path == path


def test_unwritable_directory_is_a_store_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SessionStoreError):
        SessionStore.open(blocker / "sub" / "sessions.sqlite3")


def test_concurrent_appends_from_threads(store: SessionStore) -> None:
    def worker(n: int) -> None:
        for i in range(20):
            store.append(f"t{n}", [{"role": "user", "content": str(i)}])

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for n in range(4):
        assert [m["content"] for m in store.history(f"t{n}")] == [str(i) for i in range(20)]


WRITER = """
import sys
from pathlib import Path
from slmguard.serve.sessions import SessionStore
store = SessionStore.open(Path(sys.argv[1]))
i = 0
while True:
    store.append("durable", [{"role": "user", "content": f"message {i} " + "x" * 2000}])
    print(i, flush=True)   # acknowledged: the commit returned
    i += 1
"""


def test_committed_messages_survive_kill_9_mid_write(tmp_path: Path) -> None:
    path = tmp_path / "sessions.sqlite3"
    with subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        acked = -1
        while acked < 150:
            line = proc.stdout.readline()
            assert line, "writer exited early"
            acked = int(line)
        os.kill(proc.pid, signal.SIGKILL)  # while it is in the middle of further appends
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    store = SessionStore.open(path)
    try:
        assert store.integrity_ok()
        contents = [m["content"].split(" ")[1] for m in store.history("durable")]
        # Every acknowledged commit is there, in order, with no holes; at most the
        # commits after the last acknowledgement are extra.
        assert len(contents) >= acked + 1
        assert contents == [str(i) for i in range(len(contents))]
        store.append("durable", [{"role": "user", "content": "after restart"}])
        assert store.history("durable")[-1]["content"] == "after restart"
    finally:
        store.close()


def test_tool_call_turns_keep_their_whole_shape(store: SessionStore) -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    turn = [
        {"role": "user", "content": "weather?", "name": "alice"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "assistant", "content": "It rains.", "reasoning_content": "easy"},
        {"role": "user", "content": [{"type": "text", "text": "thanks "},
                                     {"type": "text", "text": "a lot"}]},
    ]  # fmt: skip
    store.append("t", turn)
    back = store.history("t")
    assert back[:4] == turn[:4]
    assert back[4] == {"role": "user", "content": "thanks a lot"}  # text parts joined


def test_a_schema_1_database_is_migrated_in_place(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL,"
        " role TEXT NOT NULL, content TEXT NOT NULL, tokens INTEGER, created_s REAL NOT NULL);"
        "INSERT INTO messages (session_id, role, content, tokens, created_s)"
        " VALUES ('s', 'user', 'old turn', 3, 0);"
        "PRAGMA user_version=1;"
    )
    conn.close()
    store = SessionStore.open(path)
    try:
        assert store.history("s") == [{"role": "user", "content": "old turn"}]
        store.append("s", [{"role": "assistant", "content": None, "tool_calls": []}])
        assert store.history("s")[1]["content"] is None
    finally:
        store.close()


def test_the_database_is_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        store = SessionStore.open(tmp_path / "state" / "sessions.sqlite3")
        store.append("p", [{"role": "user", "content": "secret"}])
    finally:
        os.umask(old)
    try:
        db = tmp_path / "state" / "sessions.sqlite3"
        assert os.stat(db.parent).st_mode & 0o777 == 0o700
        for f in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
            assert os.stat(f).st_mode & 0o777 == 0o600, f
    finally:
        store.close()
    # An existing world-readable database is tightened when opened.
    db.chmod(0o644)
    SessionStore.open(db).close()
    assert os.stat(db).st_mode & 0o777 == 0o600


def test_drop_oldest_keeps_system_messages(store: SessionStore) -> None:
    store.append("d", [{"role": "system", "content": "rules"},
                       {"role": "user", "content": "1"}, {"role": "assistant", "content": "a"},
                       {"role": "user", "content": "2"}])  # fmt: skip
    assert store.drop_oldest("d", 2) == 2
    assert [m["content"] for m in store.history("d")] == ["rules", "2"]
    assert store.drop_oldest("d", 0) == 0


def test_session_service_prompt_and_record_turn(store: SessionStore) -> None:
    import asyncio

    from slmguard.serve.sessions import SessionService

    svc = SessionService(store)

    async def scenario() -> None:
        sys_msg = {"role": "system", "content": "be brief"}
        first = [sys_msg, {"role": "user", "content": "hello there"}]
        assert await svc.session_prompt("s", first) == first
        await svc.record_turn("s", first, {"role": "assistant", "content": "hi!"},
                              prompt_tokens=20, completion_tokens=3)  # fmt: skip
        second = [sys_msg, {"role": "user", "content": "again"}]
        prompt = await svc.session_prompt("s", second)
        assert [m["content"] for m in prompt] == ["hello there", "hi!", "be brief", "again"]
        await svc.record_turn("s", second, {"role": "assistant", "content": "ok"},
                              prompt_tokens=30, completion_tokens=1)  # fmt: skip

    asyncio.run(scenario())
    stored = store.messages("s")
    # The system prompt re-sent on the second turn is not stored twice.
    assert [m.role for m in stored] == ["system", "user", "assistant", "user", "assistant"]
    assert all(m.tokens and m.tokens > 0 for m in stored)
    assert stored[2].tokens == 3 and stored[4].tokens == 1


def _committed(path: Path, session_id: str) -> list[str]:
    """The session's messages as another reader sees the file (committed only)."""
    db = sqlite3.connect(path)
    try:
        rows = db.execute("SELECT content FROM messages WHERE session_id = ? ORDER BY id",
                          (session_id,))  # fmt: skip
        return [r[0] for r in rows]
    finally:
        db.close()


def test_deferred_turns_are_read_at_once_and_committed_together(store: SessionStore) -> None:
    """Batched writes (issue 40: an SD card wears by the block): deferred turns are in
    every read at once, in order; a write (trim, delete, drop) commits them first; at most
    max_pending_turns wait; flush and close commit them."""
    store.append("a", [{"role": "user", "content": "one"}], tokens=[1])
    store.append("a", [{"role": "assistant", "content": "two"}], tokens=[1], defer=True)
    store.append("b", [{"role": "user", "content": "three"}], tokens=[1], defer=True)
    assert store.pending == 2
    assert [m["content"] for m in store.history("a")] == ["one", "two"]
    assert store.sessions() == ["a", "b"] and _committed(store.path, "a") == ["one"]
    assert store.drop_oldest("b", 1) == 1  # a write: committed first, then dropped
    assert store.pending == 0 and _committed(store.path, "a") == ["one", "two"]
    store.max_pending_turns = 2
    for i in range(3):  # the third finds two waiting: all three committed now
        store.append("c", [{"role": "user", "content": f"c{i}"}], defer=True)
    assert store.pending == 0 and _committed(store.path, "c") == ["c0", "c1", "c2"]
    store.append("c", [{"role": "user", "content": "c3"}], defer=True)
    store.flush()
    assert _committed(store.path, "c")[-1] == "c3"
    store.append("c", [{"role": "user", "content": "c4"}], defer=True)
    store.close()
    again = SessionStore.open(store.path)
    assert [m.content for m in again.messages("c")][-1] == "c4"
    again.close()


def test_the_server_commits_a_turn_within_its_deferral(store: SessionStore) -> None:
    import asyncio

    from slmguard.serve.sessions import SessionService
    from waiting import wait_for

    store.defer_s = 0.2
    svc = SessionService(store)

    async def scenario() -> None:
        await svc.record_turn("s", [{"role": "user", "content": "hi"}],
                              {"role": "assistant", "content": "hello"},
                              prompt_tokens=5, completion_tokens=1)  # fmt: skip
        assert store.pending == 1 and _committed(store.path, "s") == []
        await asyncio.to_thread(wait_for, lambda: _committed(store.path, "s"), 10.0,
                                "the deferred turn committed", interval_s=0.2)  # fmt: skip

    asyncio.run(scenario())
    assert _committed(store.path, "s") == ["hi", "hello"] and store.pending == 0


def _wal_bytes(path: Path) -> int:
    wal = path.with_name(path.name + "-wal")
    return wal.stat().st_size if wal.exists() else 0


def test_a_turn_committed_alone_writes_small_pages(tmp_path: Path) -> None:
    # Issue 40: a board's session turns mostly come slower than the 2 s batching window,
    # so each commits alone; its changed pages go whole to the WAL. With SQLite's 4 KiB
    # default a turn put 4 frames of 4120 bytes there; 1 KiB pages put about a quarter.
    path = tmp_path / "sessions.sqlite3"
    store = SessionStore.open(path)
    try:
        store.append("warm", [{"role": "user", "content": "hi"}])
        before = _wal_bytes(path)
        for i in range(20):
            store.append(f"s-{i % 4}", [{"role": "user", "content": f"Say {i} words."},
                                        {"role": "assistant", "content": "One two."}])  # fmt: skip
        per_turn = (_wal_bytes(path) - before) / 20
        assert per_turn < 8 * 1024, per_turn
        assert store.history("s-1")[-1]["content"] == "One two."
    finally:
        store.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA page_size").fetchone()[0] == PAGE_SIZE


def test_an_existing_database_keeps_its_page_size(tmp_path: Path) -> None:
    path = tmp_path / "sessions.sqlite3"
    with sqlite3.connect(path) as conn:  # a store made before issue 40's page size
        conn.execute("PRAGMA page_size=4096")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t (x)")
    conn.close()
    store = SessionStore.open(path)
    try:
        store.append("a", [{"role": "user", "content": "hi"}])
        assert store.history("a") == [{"role": "user", "content": "hi"}]
    finally:
        store.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA page_size").fetchone()[0] == 4096
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
