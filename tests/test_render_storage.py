"""The board storage settings render and apply offer (issue 40): the journal's drop-in and
noatime in fstab, opt-in, byte-exact elsewhere, undone by rollback."""

from __future__ import annotations

from pathlib import Path

import pytest

from rendertrees import make_board_root, make_plan, snapshot, write
from slmguard.deploy.apply import apply_plan
from slmguard.deploy.hosttools import post_commands
from slmguard.deploy.render import RenderOptions, render_files
from slmguard.deploy.rollback import rollback
from slmguard.deploy.storage import JOURNALD_DROPIN, add_noatime, journald_conf
from slmguard.errors import UsageError

#: fstabs as boards ship them (the line widths and comments kept).
DEBIAN = (
    "# /etc/fstab: static file system information.\n"
    "UUID=1c5ef8a1-4f6e-4a53-9d0b-3e2f7c1a9b00 /               ext4    errors=remount-ro 0 1\n"
    "UUID=77d2-1A2B  /boot/efi       vfat    umask=0077      0       1\n"
)
JETSON = (
    "# <file system> <mount point> <type> <options> <dump> <pass>\n/dev/root / ext4 defaults 0 1\n"
)
SPLIT_VAR = (
    "/dev/mmcblk0p2 / ext4 defaults,relatime 0 1\n"
    "/dev/mmcblk0p3\t/var\text4\tdefaults,strictatime,commit=60\t0 2\n"
    "tmpfs /tmp tmpfs defaults 0 0\n"
    "#/dev/sda1 /var/lib ext4 defaults 0 2\n"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (DEBIAN, DEBIAN.replace("errors=remount-ro 0 1", "errors=remount-ro,noatime 0 1")),
        (JETSON, JETSON.replace(" defaults 0 1", " defaults,noatime 0 1")),
        (
            SPLIT_VAR,
            SPLIT_VAR.replace("defaults,relatime", "defaults,noatime").replace(
                "defaults,strictatime,commit=60", "defaults,commit=60,noatime"
            ),
        ),
        ("UUID=x / ext4 defaults,noatime 0 1\n", "UUID=x / ext4 defaults,noatime 0 1\n"),
    ],
    ids=["debian", "jetson-l4t", "split-var", "already"],
)
def test_noatime_goes_on_the_state_directorys_mounts_only(text: str, expected: str) -> None:
    assert add_noatime(text) == expected
    assert add_noatime(expected) == expected  # idempotent


def test_journal_modes_and_refusals() -> None:
    assert journald_conf("keep") is None
    capped, volatile = journald_conf("capped"), journald_conf("volatile")
    assert capped is not None and "SystemMaxUse=64M" in capped and "[Journal]" in capped
    assert volatile is not None and "Storage=volatile" in volatile
    with pytest.raises(UsageError, match="--journal"):
        render_files(make_plan(), RenderOptions(journal="off"))


@pytest.mark.parametrize("journal", ["capped", "volatile"])
def test_apply_writes_the_storage_settings_and_rollback_takes_them_back(
    tmp_path: Path, journal: str
) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    write(root, "etc/fstab", DEBIAN)
    before = snapshot(root)
    opts = RenderOptions(exec_path="/usr/bin/slmguard", journal=journal, noatime=True)
    result = apply_plan(make_plan(), opts, root)
    dropin = root / JOURNALD_DROPIN.lstrip("/")
    assert dropin.read_text() == journald_conf(journal)
    assert "errors=remount-ro,noatime" in (root / "etc/fstab").read_text()
    assert any("noatime takes effect at the next mount" in n for n in result.notes)
    assert apply_plan(make_plan(), opts, root).changes == ()  # idempotent
    rollback(root)
    assert snapshot(root) == before


def test_without_the_options_nothing_of_it_is_written(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    write(root, "etc/fstab", DEBIAN)
    apply_plan(make_plan(), RenderOptions(exec_path="/usr/bin/slmguard"), root)
    assert not (root / JOURNALD_DROPIN.lstrip("/")).exists()
    assert "noatime" not in (root / "etc/fstab").read_text()


def test_journald_restarts_after_its_dropin_changes_on_the_real_root() -> None:
    cmds = post_commands(Path("/"), [JOURNALD_DROPIN], which=lambda _: "/bin/x")
    assert ("systemctl", "restart", "systemd-journald") in cmds
