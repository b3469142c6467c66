"""``slmguard serve`` with its state directory on a filesystem that fills up (issue 40).

The real server (``slmguard serve`` as a user starts it, the real engine) with
``--state-dir`` on a small tmpfs (``tests/smallfs.py``), filled until the kernel says
ENOSPC while it serves: it keeps serving (chat, completions, /health), a session turn is
refused clearly (507 ``session_store_full``, never a 500), and once space returns the
same session takes turns again with everything it had, the database whole.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import httpx
import pytest

from serveproc import MODEL_ID, REQUEST_TIMEOUT_S, start_server
from smallfs import fill, free, small_tmpfs

pytestmark = pytest.mark.engine

MiB = 1 << 20


def _chat(url: str, session: str | None, text: str) -> httpx.Response:
    body = {"model": MODEL_ID, "max_tokens": 2,
            "messages": [{"role": "user", "content": text}]}  # fmt: skip
    if session is not None:
        body["session_id"] = session
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)


def test_serve_keeps_serving_on_a_full_state_disk_and_sessions_come_back(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "fs", 16 * MiB) as fs:
        state = fs / "state"
        srv = start_server(tmp_path, ["--state-dir", str(state)])
        try:
            assert _chat(srv.url, "kitchen-1", "Turn 1.").status_code == 200
            filler = fill(fs)
            refused = _chat(srv.url, "kitchen-1", "Turn 2.")
            assert refused.status_code == 507, refused.text
            error = refused.json()["error"]
            assert error["code"] == "session_store_full"
            assert "send it without a session_id" in error["message"]
            assert _chat(srv.url, None, "No session.").status_code == 200
            prompt = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 2}
            done = httpx.post(srv.url + "/v1/completions", json=prompt, timeout=REQUEST_TIMEOUT_S)
            assert done.status_code == 200
            health = srv.health()
            assert health is not None and health["state"] == "ready"
            free(filler)
            assert _chat(srv.url, "kitchen-1", "Turn 3.").status_code == 200
        finally:
            srv.stop()
        db = sqlite3.connect(state / "sessions.sqlite3")
        try:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            users = db.execute("SELECT content FROM messages WHERE role = 'user' ORDER BY id")
            assert [r[0] for r in users] == ["Turn 1.", "Turn 3."]
        finally:
            db.close()
