"""Bytes a session turn writes to storage: committed alone, and batched (issue 40).

The session store (``slmguard.serve.sessions.SessionStore``) on this machine's disk,
``--turns`` turns over four sessions, each turn a user message and an answer: once
committed one at a time (every turn its own transaction and fsync, the store before
issue 40) and once deferred (the server's way now: turns kept in memory and committed
together, up to ``max_pending_turns`` at a time, or every ``defer_s``), each in a
database of 4096-byte pages (SQLite's default: a store made before) and in a new store
(``sessions.PAGE_SIZE``); then up to 200 turns as on a quiet board (each turn's history
read first, everything written back after it). Counted: this
process's ``/proc/self/io`` ``write_bytes`` (what it sent to the block layer: the WAL,
the checkpoints into the database file) after an ``fsync`` of everything, per turn,
and the fsyncs. The filesystem's own journal (ext4's jbd2, per fsync) is not counted:
it comes on top, and more so for one fsync a turn. A ratio in one run, not a speed.
Written to benchmarks/RESULTS.md, section ``## session writes``.

Usage: ``.venv/bin/python benchmarks/session_writes.py [--turns 2000] [--no-write]``
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_md import write_section

from slmguard.host.footprint import read_io
from slmguard.serve.sessions import PAGE_SIZE, SessionStore

SECTION = "## session writes"


def turn(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Say {i % 13} words, please."},
            {"role": "assistant", "content": "One two three four five six seven."}]  # fmt: skip


def written(
    turns: int, *, defer: bool, root: Path, page_size: int, slow: bool = False
) -> tuple[float, int]:
    """(bytes written per turn, turns per commit) for ``turns`` turns, the database's
    pages ``page_size`` bytes (other than the store's own: a database made before).
    ``slow``: each turn as on a quiet board, its history read first and everything
    written back after it (``sync``, as the kernel does within 30 s), so that no turn
    finds a page still dirty from the one before."""
    path = Path(tempfile.mkdtemp(dir=root)) / "sessions.sqlite3"
    if page_size != PAGE_SIZE:  # a store made before its page size was chosen
        conn = sqlite3.connect(path)
        conn.execute(f"PRAGMA page_size={page_size}")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.close()
    store = SessionStore.open(path)
    os.sync()
    before = read_io()
    for i in range(turns):
        if slow:
            store.history(f"s-{i % 4}")
        store.append(f"s-{i % 4}", turn(i), tokens=[7, 9], defer=defer)
        if slow:
            os.sync()
    store.close()
    os.sync()
    after = read_io()
    assert before is not None and after is not None
    per_commit = store.max_pending_turns + 1 if defer else 1
    return (after.write_bytes - before.write_bytes) / turns, per_commit


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=2000)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="slmguard-sessions-", dir="/var/tmp") as tmp:
        for page in (4096, PAGE_SIZE):
            for defer in (False, True):
                rows[page, defer] = written(args.turns, defer=defer, root=Path(tmp),
                                            page_size=page)  # fmt: skip
            rows[page, "slow"] = written(min(args.turns, 200), defer=False, root=Path(tmp),
                                         page_size=page, slow=True)  # fmt: skip
    load = Path("/proc/loadavg").read_text().split()[:3]
    per_commit = rows[PAGE_SIZE, True][1]

    def row(what: str, page: int, defer: bool | str) -> str:
        per_turn, n = rows[page, defer]
        return f"| {what} | {page} | {per_turn / 1024:.1f} KiB | {1000 // n} |\n"

    alone_4k, alone = rows[4096, False][0], rows[PAGE_SIZE, False][0]
    text = (
        f"{SECTION}\n\n"
        f"`benchmarks/session_writes.py --turns {args.turns}` "
        f"({time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, load average "
        f"{' / '.join(load)}; the store on this machine's ext4, `synchronous=FULL`, WAL):\n\n"
        "| session turns | page size (bytes) | written to storage per turn | "
        "commits (fsyncs) per 1,000 turns |\n"
        "|---|---|---|---|\n"
        + row("each committed alone (slower than one per 2 s)", 4096, False)
        + row(f"batched, up to {per_commit} a commit (busy)", 4096, True)
        + row("each committed alone (slower than one per 2 s)", PAGE_SIZE, False)
        + row(f"batched, up to {per_commit} a commit (busy)", PAGE_SIZE, True)
        + row(
            "alone, a quiet board's (200 turns, each read first, written back after)", 4096, "slow"
        )
        + row(
            "alone, a quiet board's (200 turns, each read first, written back after)",
            PAGE_SIZE,
            "slow",
        )
        + f"\nThe server commits what waited every 2 s, and at once when 32 wait; a turn "
        f"slower than that commits alone, which is a board's usual case. A new store's "
        f"{PAGE_SIZE}-byte pages (an existing store keeps its 4096) write "
        f"{alone_4k / alone:.1f}x fewer bytes for such a turn: each commit writes its "
        "changed pages whole. On a quiet board every turn also finds the pages it shares "
        "with the last one written back already: the WAL's last page and the WAL index "
        "(`-shm`, dirtied by every read and commit) are written again each time. The "
        "filesystem's journal (one commit per fsync) comes on top and falls with the "
        "fsyncs.\n"
    )
    print(text)
    if not args.no_write:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
