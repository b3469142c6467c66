"""doctor's storage checks (issue 40): noatime on the state directory's filesystem and the
journal's size, read from real mountinfo and journald files in a fixture tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from hosttree import build_tree
from slmguard.deploy.storage import journald_conf
from slmguard.doctor.findings import PASS, WARN
from slmguard.doctor.storage import check_journal, check_noatime, journald_bytes
from slmguard.host.snapshot import collect
from slmguard.host.storage import mount_for, parse_journald, parse_mountinfo, read_storage

FIXTURES = Path(__file__).parent / "fixtures" / "proc"
#: This development VM's own /proc/self/mountinfo (2026-12-05): / is ext4 relatime.
DEV_VM = (FIXTURES / "mountinfo-dev-vm").read_text()
BOARD = (
    "22 1 179:2 / / rw,noatime shared:1 - ext4 /dev/mmcblk0p2 rw,commit=600\n"
    "30 22 179:3 / /var/lib rw,relatime shared:2 - f2fs /dev/mmcblk0p3 rw\n"
    "31 30 0:40 / /var/lib/slmguard rw,nosuid shared:3 - tmpfs tmpfs rw,size=65536k\n"
    "32 22 0:41 / /mnt/with\\040space rw - tmpfs tmpfs rw\n"
)


def test_the_mount_holding_a_path_is_the_longest_mount_point() -> None:
    mounts = parse_mountinfo(DEV_VM)
    root = mount_for(mounts, "/var/lib/slmguard")
    assert root is not None and (root.mount_point, root.fstype) == ("/", "ext4")
    assert "relatime" in root.options and "discard" in root.options
    board = parse_mountinfo(BOARD)
    found = mount_for(board, "/var/lib/slmguard/sessions.sqlite3")
    assert found is not None and found.in_memory and found.mount_point == "/var/lib/slmguard"
    other = mount_for(board, "/var/library")  # a prefix of characters, not of path components
    assert other is not None and other.mount_point == "/"
    assert mount_for(board, "/mnt/with space/x").mount_point == "/mnt/with space"  # type: ignore[union-attr]
    assert parse_mountinfo("garbage\n22 1 x\n") == ()


def test_journald_files_later_ones_win() -> None:
    j = parse_journald([
        ("/etc/systemd/journald.conf", "[Journal]\n#Storage=auto\nSystemMaxUse=1G\n"),
        ("/etc/systemd/journald.conf.d/50-slmguard.conf", journald_conf("capped") or ""),
    ])  # fmt: skip
    assert (j.storage, j.system_max_use) == ("persistent", "64M")
    assert parse_journald([]).storage is None
    assert [journald_bytes(v) for v in ("64M", "1G", "512", "2K", "x", None)] == [
        64 << 20, 1 << 30, 512, 2048, None, None]  # fmt: skip


def _snapshot(tmp_path: Path, mountinfo: str, journald: dict[str, str]):  # type: ignore[no-untyped-def]
    root = build_tree(tmp_path, {"proc/self/mountinfo": mountinfo, **journald})
    return collect(root)


@pytest.mark.parametrize(
    ("mountinfo", "severity", "said"),
    [
        (DEV_VM, WARN, "/ (ext4) is mounted relatime"),
        ("".join(BOARD.splitlines(keepends=True)[:2]), WARN,
         "/var/lib (f2fs) is mounted relatime"),
        (BOARD, PASS, "is tmpfs: nothing reaches the card"),
        (BOARD.splitlines()[0] + "\n", PASS, "/ is mounted noatime"),
    ],
    ids=["dev-vm-relatime", "var-lib-relatime", "state-on-tmpfs", "noatime"],
)  # fmt: skip
def test_noatime(tmp_path: Path, mountinfo: str, severity: str, said: str) -> None:
    finding = check_noatime(_snapshot(tmp_path, mountinfo, {}), None)
    assert finding.severity == severity and said in finding.summary, finding
    if severity == WARN:
        assert finding.fix is not None and "slmguard apply --noatime" in finding.fix


@pytest.mark.parametrize(
    ("files", "severity"),
    [
        ({}, WARN),
        ({"etc/systemd/journald.conf": "[Journal]\nSystemMaxUse=1G\n"}, WARN),
        ({"etc/systemd/journald.conf.d/50-slmguard.conf": journald_conf("capped") or ""}, PASS),
        ({"etc/systemd/journald.conf.d/50-slmguard.conf": journald_conf("volatile") or ""},
         PASS),
    ],
    ids=["defaults", "1G", "capped", "volatile"],
)  # fmt: skip
def test_journal(tmp_path: Path, files: dict[str, str], severity: str) -> None:
    finding = check_journal(_snapshot(tmp_path, BOARD, files), None)
    assert finding.severity == severity, finding
    if severity == WARN:
        assert finding.fix is not None and "--journal capped" in finding.fix


def test_unreadable_mounts_are_said(tmp_path: Path) -> None:
    snap = collect(build_tree(tmp_path, {"etc/hostname": "b\n"}))
    assert check_noatime(snap, None).severity == "unknown"
    assert (
        read_storage(build_tree(tmp_path / "x", {"proc/self/mountinfo": BOARD})).journald.files
        == ()
    )
