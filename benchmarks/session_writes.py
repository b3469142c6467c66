"""Bytes a session turn writes to storage: committed alone, and batched (issue 40).

The session store (``slmguard.serve.sessions.SessionStore``) on this machine's disk,
``--turns`` turns over four sessions, each turn a user message and an answer: once
committed one at a time (every turn its own transaction and fsync, the store before
issue 40) and once deferred (the server's way now: turns kept in memory and committed
together, up to ``max_pending_turns`` at a time, or every ``defer_s``). Counted: this
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
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_md import write_section

from slmguard.host.footprint import read_io
from slmguard.serve.sessions import SessionStore

SECTION = "## session writes"


def turn(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Say {i % 13} words, please."},
            {"role": "assistant", "content": "One two three four five six seven."}]  # fmt: skip


def written(turns: int, *, defer: bool, root: Path) -> tuple[float, int]:
    """(bytes written per turn, turns per commit) for ``turns`` turns."""
    store = SessionStore.open(Path(tempfile.mkdtemp(dir=root)) / "sessions.sqlite3")
    os.sync()
    before = read_io()
    for i in range(turns):
        store.append(f"s-{i % 4}", turn(i), tokens=[7, 9], defer=defer)
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
    with tempfile.TemporaryDirectory(prefix="slmguard-sessions-", dir="/var/tmp") as tmp:
        alone, _ = written(args.turns, defer=False, root=Path(tmp))
        batched, per_commit = written(args.turns, defer=True, root=Path(tmp))
    load = Path("/proc/loadavg").read_text().split()[:3]
    text = (
        f"{SECTION}\n\n"
        f"`benchmarks/session_writes.py --turns {args.turns}` "
        f"({time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, load average "
        f"{' / '.join(load)}; the store on this machine's ext4, `synchronous=FULL`, WAL):\n\n"
        "| session turns | written to storage per turn | commits (fsyncs) per 1,000 turns |\n"
        "|---|---|---|\n"
        f"| each committed alone (before issue 40) | {alone / 1024:.1f} KiB | 1000 |\n"
        f"| batched, up to {per_commit} a commit (the server now, busy) | "
        f"{batched / 1024:.1f} KiB | {1000 // per_commit} |\n\n"
        f"{alone / batched:.1f}x fewer bytes when turns come faster than one per 2 s (the "
        "server commits what waited every 2 s, and at once when 32 wait); a turn slower than "
        "that commits alone, as before. The filesystem's journal (one commit per fsync) comes "
        "on top of both and falls with the fsyncs.\n"
    )
    print(text)
    if not args.no_write:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
