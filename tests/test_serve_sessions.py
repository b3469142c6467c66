"""Server-side chat sessions (``session_id``) on a real server: history, restarts, trim.

The history lives in the governor's SQLite store under the state directory, so
it survives a SIGKILL of the whole server (front and worker).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from serveproc import MODEL_ID, ServeFactory, ServerProcess

pytestmark = pytest.mark.engine

QUESTION = "Name a colour."


def chat(
    s: ServerProcess, text: str, *, sid: str | None = None, header: str | None = None
) -> httpx.Response:
    body: dict[str, object] = {"model": MODEL_ID, "max_tokens": 2, "temperature": 0,
                               "messages": [{"role": "user", "content": text}]}  # fmt: skip
    if sid is not None:
        body["session_id"] = sid
    headers = {"X-Session-Id": header} if header is not None else {}
    return httpx.post(s.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def prompt_tokens(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens"])


def stream_prompt_tokens(s: ServerProcess, text: str, sid: str) -> int:
    body = {"model": MODEL_ID, "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "session_id": sid,
            "messages": [{"role": "user", "content": text}]}  # fmt: skip
    usage = None
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    assert usage is not None
    return int(usage["prompt_tokens"])


def gone(pid: int, timeout_s: float = 30.0) -> bool:
    """True once ``pid`` has exited (no such process, or a zombie nobody reaped yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return True
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize(
    ("sid", "header", "code"),
    [
        ("bad id!", None, "invalid_session_id"),
        ("x" * 129, None, "invalid_session_id"),
        (None, "a/b", "invalid_session_id"),
        ("one", "two", "invalid_session_id"),  # body and header disagree
    ],
)
def test_bad_session_ids_get_400(
    server: ServerProcess, sid: str | None, header: str | None, code: str
) -> None:
    resp = chat(server, QUESTION, sid=sid, header=header)
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == code
    assert resp.json()["error"]["param"] == "session_id"


def test_history_survives_kill9_and_trim_shortens_it(
    serve_factory: ServeFactory, tmp_path: Path
) -> None:
    (tmp_path / "admin").write_text("session-admin\n")
    args = ("--state-dir", str(tmp_path / "state"), "--admin-token-file", str(tmp_path / "admin"))
    s = serve_factory(*args)
    alone = prompt_tokens(chat(s, QUESTION))
    first = prompt_tokens(chat(s, QUESTION, sid="conv-1"))
    assert first == alone  # a new session has no history
    second = stream_prompt_tokens(s, QUESTION, "conv-1")  # the streamed path records too
    assert second >= 2 * alone  # the first turn (question + answer) comes before it
    other = prompt_tokens(chat(s, QUESTION, header="conv-2"))
    assert other == alone  # sessions do not mix

    # SIGKILL the whole server (front and worker share the process group).
    worker = s.health()["worker_pid"]  # type: ignore[index]
    os.killpg(s.proc.pid, signal.SIGKILL)
    s.proc.wait(30)
    assert gone(worker)
    s = serve_factory(*args)
    third = prompt_tokens(chat(s, QUESTION, header="conv-1"))
    assert third > second  # both stored turns are still there

    resp = httpx.post(
        s.url + "/api/v1/context/trim",
        json={"keep_recent": 1, "session_id": "conv-1"},
        headers={"Authorization": "Bearer session-admin"},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["messages_removed"] >= 2
    fourth = prompt_tokens(chat(s, QUESTION, sid="conv-1"))
    assert fourth < third
