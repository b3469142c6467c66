"""A full disk under the state directory and the target root (issue 40), for real: a small
tmpfs filled until the kernel says ENOSPC (``tests/smallfs.py``; root only).

- the session store refuses a new turn clearly (SessionStoreFullError: 507
  ``session_store_full``), keeps every stored turn, and takes turns again once space
  returns, whole (``PRAGMA integrity_check``);
- a turn whose write meets the full disk after its answer came is said in the answer
  (``X-Slmguard-Session-Stored: false``), not a 500;
- the watcher keeps alerting (to its own log: the journal) and keeps running, leaves no
  torn line in alerts.jsonl, and its state file stays whole;
- apply refuses before writing anything (73, with the numbers).

The server on a full state directory, end to end, is ``test_serve_full_disk.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from rendertrees import make_board_root, make_plan, snapshot
from slmguard.deploy.apply import apply_plan
from slmguard.deploy.render import RenderOptions
from slmguard.errors import NoSpaceError, SessionStoreFullError, envelope
from slmguard.governor.request import NoPolicy, SizedRequest
from slmguard.serve.flights import Flights
from slmguard.serve.generation import Generation, Turn
from slmguard.serve.readiness import RetryAfter
from slmguard.serve.relay import Relay
from slmguard.serve.sessions import SessionService, SessionStore
from slmguard.serve.sizing import Sizing, TokenLimits
from slmguard.watch.alerts import AlertSink
from slmguard.watch.rules import Alert
from slmguard.watch.state import WatchState, load_state, save_state
from smallfs import fill, free, free_bytes, small_tmpfs

MiB = 1 << 20
TURN = [{"role": "user", "content": "Name a colour."}]


def _turns(store: SessionStore, sid: str = "kitchen-1") -> list[str]:
    return [m.content for m in store.messages(sid)]


def test_a_full_store_refuses_new_turns_clearly_and_comes_back_whole(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "state", 4 * MiB) as fs:
        store = SessionStore.open(fs / "sessions.sqlite3")
        service = SessionService(store)
        store.append("kitchen-1", TURN, tokens=[5])
        filler = fill(fs)
        # Before a generation: refused with the numbers, 507 session_store_full.
        with pytest.raises(SessionStoreFullError) as refused:
            asyncio.run(service.session_prompt("kitchen-1", TURN))
        answer = envelope(refused.value)
        body = answer.body()["error"]
        assert (answer.status, body["code"]) == (507, "session_store_full")
        assert "send it without a session_id" in body["message"]
        # A write that meets the full disk: the same error, rolled back, nothing torn.
        with pytest.raises(SessionStoreFullError):
            for i in range(200):  # until the WAL needs a page the disk does not have
                store.append("kitchen-1", [{"role": "user", "content": "x" * 4000 + str(i)}])
        assert store.integrity_ok()
        kept = _turns(store)
        free(filler)
        store.append("kitchen-1", [{"role": "assistant", "content": "Blue."}], tokens=[2])
        assert _turns(store) == [*kept, "Blue."] and store.integrity_ok()
        store.close()
        again = SessionStore.open(fs / "sessions.sqlite3")  # reopens: nothing corrupt
        assert _turns(again)[0] == "Name a colour." and again.integrity_ok()
        again.close()


def test_a_turn_the_full_disk_would_not_keep_is_said_in_the_answer(tmp_path: Path) -> None:
    """The answer came; storing its turn met the full disk (no room left to defer it
    either): the answer is sent (no 500) with X-Slmguard-Session-Stored: false, and the
    store is whole."""
    with small_tmpfs(tmp_path / "state", 4 * MiB) as fs:
        store = SessionStore.open(fs / "sessions.sqlite3")
        store.max_pending_turns = 0  # nothing deferred: committed with the answer
        engine = SimpleNamespace(state="ready", recycling=False, config=SimpleNamespace())
        queue = SimpleNamespace(slots=1)
        sizing = Sizing(NoPolicy(), TokenLimits(), settings=lambda: engine.config,
                        slots=lambda: queue.slots)  # fmt: skip
        relay = Relay(engine, queue, Flights(), None, NoPolicy(), sizing,  # type: ignore[arg-type]
                      retry_after=RetryAfter(2, 60), sessions=SessionService(store))  # fmt: skip
        gen = Generation(
            "chat", "/v1/chat/completions", {}, False, False, SizedRequest("chat", 9, 4)
        )
        gen.turn = Turn("kitchen-1", [{"role": "user", "content": "y" * 200_000}])
        filler = fill(fs)
        asyncio.run(relay.record(gen, {"content": "Blue."}, {"prompt_tokens": 9}))
        assert gen.turn.stored is False
        assert gen.session_header()["X-Slmguard-Session-Stored"] == "false"
        free(filler)
        assert store.integrity_ok() and _turns(store) == []
        store.close()


def test_the_watcher_alerts_to_its_log_when_the_alert_file_cannot_grow(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with small_tmpfs(tmp_path / "state", 1 * MiB) as fs:
        sink = AlertSink(fs / "alerts.jsonl")
        sink.emit(Alert("warning", "memory-high", "working set at 86% of limit"))
        save_state(fs / "watch-state.json", WatchState(boot_id="b", kmsg_seq=7))
        filler = fill(fs)
        caplog.set_level(logging.WARNING, logger="slmguard.watch.alerts")
        big = Alert("critical", "oom-kill", "OOM killer killed llama-server (pid 3101)",
                    {"pad": "z" * 8192})  # fmt: skip
        sink.emit(big)  # no exception: the watchdog goes on
        assert sink.log_failures == 1
        (said,) = [r for r in caplog.records if "oom-kill" in r.getMessage()]
        assert said.levelno == logging.ERROR and "No space left" in said.getMessage()
        with pytest.raises(OSError):
            save_state(fs / "watch-state.json", WatchState(boot_id="b", kmsg_seq=9))
        assert load_state(fs / "watch-state.json").kmsg_seq == 7  # the old state, whole
        free(filler)
        sink.emit(Alert("info", "recovered", "memory-high cleared"))
        lines = (fs / "alerts.jsonl").read_text().splitlines()
        assert [json.loads(x)["kind"] for x in lines] == ["memory-high", "recovered"]


def test_apply_refuses_a_full_disk_before_writing_anything(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "root", 8 * MiB) as fs:
        root = make_board_root(fs, "armbian")
        filler = fill(fs)
        before = snapshot(root)
        with pytest.raises(NoSpaceError) as refused:
            apply_plan(make_plan(), RenderOptions(exec_path="/usr/bin/slmguard"), root)
        assert refused.value.exit_code == 73
        assert refused.value.have_bytes < refused.value.need_bytes
        assert "refused before writing anything" in refused.value.message
        assert snapshot(root) == before
        free(filler)
        assert free_bytes(fs) > refused.value.need_bytes
        result = apply_plan(make_plan(), RenderOptions(exec_path="/usr/bin/slmguard"), root)
        assert result.changes and result.manifest is not None
