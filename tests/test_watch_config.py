"""`slmguard watch` refuses what it could never use, at config time; crash bundles are private."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from slmguard.cli import main
from slmguard.errors import ConfigError, UsageError
from slmguard.watch.bundle import BundleInputs, write_bundle
from slmguard.watch.config import WatchConfig


def _watch(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(["watch", "--once", *argv])
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out + err


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid  # reaped: no /proc entry until the number is reused


@pytest.mark.parametrize(
    ("argv", "code", "needle"),
    [
        (["--webhook", "file:///etc/passwd"], 78, "need an http:// or https:// URL"),
        (["--webhook", "ftp://10.0.0.5/alerts"], 78, "need an http:// or https:// URL"),
        (["--webhook", "http:///no-host"], 78, "with a host"),
        (["--webhook", "http://10.0.0.5:port/"], 78, "--webhook"),
        (["--webhook", "http://10.0.0.5/a\r\nX-Injected: 1"], 78, "control characters"),
        (["--server", "file:///run/x.sock"], 78, "--server"),
        (["--pid", "0"], 64, "not a process id"),
        (["--pid", "{dead}"], 64, "no such process"),
    ],
)
def test_bad_webhooks_and_pids_are_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], code: int, needle: str
) -> None:
    args = [a.format(dead=_dead_pid()) for a in argv]
    got, out = _watch(capsys, "--state-dir", str(tmp_path), *args)
    assert got == code, out
    assert needle in out and len(out.strip().splitlines()) <= 2  # the error and a hint
    assert not (tmp_path / "alerts.jsonl").exists()


def test_good_urls_and_a_live_pid_are_accepted(tmp_path: Path) -> None:
    cfg = WatchConfig(
        state_dir=tmp_path,
        webhook_url="https://hooks.example.org/a?b=c",
        server_url="http://127.0.0.1:8080",
        pids=(os.getpid(),),
    )
    assert cfg.pids == (os.getpid(),)
    with pytest.raises(ConfigError, match="file://"):
        WatchConfig(state_dir=tmp_path, webhook_url="file:///tmp/x")
    with pytest.raises(UsageError, match="no such process"):
        WatchConfig(state_dir=tmp_path, pids=(os.getpid(),), root=tmp_path)  # another root


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_crash_bundles_are_private_whatever_the_umask(tmp_path: Path, open_umask: None) -> None:
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "front.log").write_text("Thread 0x1 (most recent call first):\n")
    crashes = tmp_path / "crashes"
    crashes.mkdir(mode=0o777)  # made before, by an older version, world-open
    bundle = write_bundle(
        crashes,
        BundleInputs("on-demand", faults_dir=faults, health={"status": "ok"}),
        journal=lambda unit: "journal\n",
    )
    assert stat.S_IMODE(crashes.stat().st_mode) == 0o700
    modes = {str(p.relative_to(bundle)): stat.S_IMODE(p.stat().st_mode) for p in bundle.rglob("*")}
    assert stat.S_IMODE(bundle.stat().st_mode) == 0o700
    assert modes["faults"] == 0o700
    assert {k: v for k, v in modes.items() if k != "faults"} == {
        "faults/front.log": 0o600,
        "health.json": 0o600,
        "journal.txt": 0o600,
        "summary.json": 0o600,
    }
