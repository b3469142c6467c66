"""systest.qmp: the faults target's power cut, against a real qemu (``-machine none``).

qemu runs as the systest runs it, with ``-no-reboot``: a plain ``system_reset`` then ends
qemu (the run, and the guest's disk overlay, would be gone), while :func:`power_cut`
resets and keeps it running. Skipped where qemu-system-x86_64 is not installed
(``make systest`` installs it).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from waiting import scaled, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the systest package
from systest import qmp

QEMU = shutil.which("qemu-system-x86_64")
pytestmark = pytest.mark.skipif(QEMU is None, reason="qemu-system-x86_64 is not installed")


@contextlib.contextmanager
def qemu(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    sock = tmp_path / "qmp.sock"
    assert QEMU is not None
    proc = subprocess.Popen(
        [QEMU, "-machine", "none", "-nodefaults", "-display", "none", "-no-reboot",
         "-qmp", f"unix:{sock},server=on,wait=off"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(sock.exists, scaled(30), "qemu's monitor socket")
        yield proc, sock
    finally:
        proc.kill()
        proc.wait(timeout=scaled(30))


def _status(sock: Path) -> str:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(scaled(30))
        s.connect(str(sock))
        with s.makefile("rb") as f:
            f.readline()  # the greeting
            qmp._call(f, s, "qmp_capabilities")
            return str(qmp._call(f, s, "query-status")["status"])


def _reset(sock: Path) -> None:
    """A reset qemu did not get from power_cut (SeaBIOS's own, after a warm reset)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(scaled(30))
        s.connect(str(sock))
        with s.makefile("rb") as f:
            f.readline()
            qmp._call(f, s, "qmp_capabilities")
            qmp._call(f, s, "system_reset")


def test_a_power_cut_resets_the_machine_and_qemu_goes_on(tmp_path: Path) -> None:
    with qemu(tmp_path) as (proc, sock):
        qmp.power_cut(sock)
        assert _status(sock) == "running" and proc.poll() is None
        _reset(sock)  # the firmware's second reset, until the guest runs again
        assert _status(sock) == "running" and proc.poll() is None
        qmp.reboots_end_qemu(sock)  # the guest runs its scenario again
        qmp.power_cut(sock)  # again: the reboot action set again
        assert proc.poll() is None
        qmp.reboots_end_qemu(sock)
        _reset(sock)  # -no-reboot again: a reboot ends qemu
        wait_for(lambda: proc.poll() is not None, scaled(30), "qemu to exit")


def test_a_plain_reset_under_no_reboot_ends_qemu(tmp_path: Path) -> None:
    """Why power_cut sets the reboot action: without it the reset is a shutdown."""
    with qemu(tmp_path) as (proc, sock):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(scaled(30))
            s.connect(str(sock))
            with s.makefile("rb") as f:
                f.readline()
                qmp._call(f, s, "qmp_capabilities")
                s.sendall(json.dumps({"execute": "system_reset"}).encode() + b"\r\n")
                wait_for(lambda: proc.poll() is not None, scaled(30), "qemu to exit")
        assert proc.returncode == 0


def test_a_missing_monitor_is_a_qmp_error(tmp_path: Path) -> None:
    with pytest.raises(qmp.QmpError, match=r"qmp\.sock"):
        qmp.power_cut(tmp_path / "qmp.sock", timeout_s=scaled(5))


def test_each_power_cut_is_a_host_line_of_the_report(tmp_path: Path) -> None:
    """systest.vm reports the reset it did for a guest's power-cut event, or why it could
    not (a hidden log line left the guest waiting with nothing in the report)."""
    from systest import report, vm

    event = {"event": "power-cut", "step": "power-cut-apply"}
    with qemu(tmp_path) as (proc, sock):
        done = vm.power_cut_step(sock, event)
        assert proc.poll() is None
    assert (done.step, done.status, done.where) == (vm.POWER_CUT_STEP, report.PASS, "host")
    assert "power-cut-apply" in done.reason
    failed = vm.power_cut_step(tmp_path / "gone.sock", event)
    assert failed.status == report.FAIL and "gone.sock" in failed.reason
