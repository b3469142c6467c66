"""Boot file parsing and editing (Armbian, Rockchip uEnv, Jetson extlinux) and kernel arguments."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rendertrees import ARMBIAN_ENV, JETSON_EXTLINUX, ROCKCHIP_UENV, MiB, make_board_root, write
from slmguard.errors import BootFileError, HostReadError
from slmguard.host import bootfiles, kernelargs
from slmguard.host.bootfiles import ARMBIAN, CMDLINE, EXTLINUX, UENV


def test_parse_armbian_gives_root_from_rootdev_and_extraargs() -> None:
    args = bootfiles.parse_armbian_env(ARMBIAN_ENV)
    assert args == ("root=UUID=6f1e4c2a-3b8d-4e0f-9a51-2c7d8e9f0a1b", "cma=256M")


def test_parse_uenv_reads_bootargs() -> None:
    args = bootfiles.parse_uenv(ROCKCHIP_UENV)
    assert "root=PARTLABEL=rootfs" in args
    assert args[0] == "earlycon=uart8250,mmio32,0xfeb50000"
    assert kernelargs.arg_value(args, "cma") is None


def test_parse_extlinux_uses_default_label_and_ignores_commented_backup() -> None:
    conf = bootfiles.parse_extlinux(JETSON_EXTLINUX)
    assert [label.name for label in conf.labels] == ["primary"]
    args = bootfiles.parse_extlinux_args(JETSON_EXTLINUX)
    assert args[0] == "${cbootargs}"
    assert "root=PARTUUID=0b8a4a3e-8d6b-4b0c-9d8e-1f2a3b4c5d6e" in args


@pytest.mark.parametrize(
    ("kind", "text"), [(ARMBIAN, ARMBIAN_ENV), (UENV, ROCKCHIP_UENV), (EXTLINUX, JETSON_EXTLINUX)]
)
def test_set_cma_changes_one_line_and_is_idempotent(kind: str, text: str) -> None:
    new = bootfiles.set_boot_arg(kind, text, "cma", "512M", "f")
    old_lines, new_lines = text.splitlines(), new.splitlines()
    assert len(old_lines) == len(new_lines)
    differing = [i for i, (a, b) in enumerate(zip(old_lines, new_lines, strict=True)) if a != b]
    assert len(differing) == 1
    args = bootfiles.parse_boot_file(kind, new, "f")
    assert [a for a in args if a.startswith("cma=")] == ["cma=512M"]
    assert kernelargs.has_root(args)
    assert bootfiles.set_boot_arg(kind, new, "cma", "512M", "f") == new


def test_set_arg_replaces_first_and_drops_duplicates_keeping_quotes() -> None:
    line = 'quiet cma=64M dyndbg="file a.c +p" cma=1G rw'
    assert kernelargs.set_arg(line, "cma", "2G") == 'quiet cma=2G dyndbg="file a.c +p" rw'
    assert kernelargs.set_arg("", "cma", "2G") == "cma=2G"
    assert kernelargs.set_arg("quiet\n", "cma", "2G") == "quiet cma=2G\n"
    assert kernelargs.tokens('a="b c" d') == ('a="b c"', "d")


def test_armbian_without_extraargs_gets_a_new_line() -> None:
    text = "verbosity=1\nrootdev=/dev/mmcblk0p2"
    new = bootfiles.set_boot_arg(ARMBIAN, text, "cma", "128M", "f")
    assert new == "verbosity=1\nrootdev=/dev/mmcblk0p2\nextraargs=cma=128M\n"


def test_crlf_line_endings_are_kept() -> None:
    text = ARMBIAN_ENV.replace("\n", "\r\n")
    new = bootfiles.set_boot_arg(ARMBIAN, text, "cma", "1G", "f")
    assert "extraargs=cma=1G\r\n" in new
    assert new.count("\r\n") == text.count("\r\n")


@pytest.mark.parametrize(
    ("kind", "text", "needle"),
    [
        (ARMBIAN, "verbosity=1\nthis is not an env line\n", "not a key=value line"),
        (ARMBIAN, "rootdev=/dev/a\nextraargs=x\nextraargs=y\n", "set twice"),
        (ARMBIAN, "rootdev=/dev/a\x00\n", "NUL"),
        (UENV, "fdtfile=x.dtb\n", "no bootargs="),
        (EXTLINUX, "APPEND root=/dev/a\nLABEL x\n", "APPEND outside a LABEL"),
        (EXTLINUX, "DEFAULT nope\nLABEL x\n  APPEND root=/dev/a\n", "names no LABEL"),
        (EXTLINUX, "LABEL x\n  APPEND root=/dev/a\n  APPEND quiet\n", "two APPEND"),
        (EXTLINUX, "TIMEOUT 30\n", "no LABEL"),
        (EXTLINUX, "LABEL x\n  [weird]\n", "not a KEYWORD line"),
    ],
)
def test_unparseable_files_are_refused(kind: str, text: str, needle: str) -> None:
    with pytest.raises(BootFileError, match=re.escape(needle)):
        bootfiles.set_boot_arg(kind, text, "cma", "64M", "bootfile")


@pytest.mark.parametrize(
    ("kind", "text"),
    [
        (ARMBIAN, "verbosity=1\nextraargs=quiet\n"),  # no rootdev
        (UENV, "bootargs=console=ttyFIQ0 rootwait\n"),  # no root=
        (EXTLINUX, "LABEL primary\n  LINUX /boot/Image\n"),  # no APPEND at all
        (EXTLINUX, "LABEL primary\n  APPEND ${cbootargs} quiet\n"),  # APPEND without root=
    ],
)
def test_edit_leaving_no_root_is_refused(kind: str, text: str) -> None:
    with pytest.raises(BootFileError, match="root="):
        bootfiles.set_boot_arg(kind, text, "cma", "64M", "bootfile")


def test_extlinux_edits_only_the_default_label() -> None:
    text = (
        "DEFAULT second\n"
        "LABEL first\n  APPEND root=/dev/a quiet\n"
        "LABEL second\n  APPEND root=/dev/b\n"
    )
    new = bootfiles.set_boot_arg(EXTLINUX, text, "cma", "64M", "f")
    assert "APPEND root=/dev/a quiet\n" in new
    assert "APPEND root=/dev/b cma=64M\n" in new


PI_CMDLINE = (
    "console=serial0,115200 console=tty1 root=PARTUUID=4e639091-02 rootfstype=ext4 "
    "fsck.repair=yes rootwait cfg80211.ieee80211_regdom=GB\n"
)


def test_raspberry_pi_cmdline_txt(tmp_path: Path) -> None:
    assert "root=PARTUUID=4e639091-02" in bootfiles.parse_cmdline_txt(PI_CMDLINE)
    new = bootfiles.set_boot_arg(CMDLINE, PI_CMDLINE, "cma", "256M", "cmdline.txt")
    assert new == PI_CMDLINE.replace("\n", " cma=256M\n")
    write(tmp_path, "boot/firmware/cmdline.txt", new)
    found = bootfiles.read_boot_args(tmp_path, "/boot/firmware/cmdline.txt")
    assert found is not None and found.kind == CMDLINE and found.cma_bytes == 256 * MiB
    assert bootfiles.read_boot_args(tmp_path) == found
    with pytest.raises(BootFileError, match="one line"):
        bootfiles.parse_cmdline_txt("root=/dev/a\nquiet\n")
    with pytest.raises(BootFileError, match="root="):
        bootfiles.set_boot_arg(CMDLINE, "\n", "cma", "64M", "cmdline.txt")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("256M", 256 * MiB), ("2G", 2 << 30), ("0x1000", 4096), ("64k", 64 << 10), ("100", 100)],
)
def test_memparse(text: str, expected: int) -> None:
    assert kernelargs.parse_memparse(text) == expected


def test_memparse_refuses_garbage_and_format_picks_exact_unit() -> None:
    with pytest.raises(ValueError, match="not a kernel size"):
        kernelargs.parse_memparse("12Q")
    assert kernelargs.format_memparse(2 << 30) == "2G"
    assert kernelargs.format_memparse(1536 * MiB) == "1536M"
    assert kernelargs.format_memparse(4097) == "4097"


@pytest.mark.parametrize("board", ["armbian", "uenv", "extlinux"])
def test_read_boot_args_from_a_board_root(tmp_path: Path, board: str) -> None:
    make_board_root(tmp_path, board)
    found = bootfiles.read_boot_args(tmp_path)
    assert found is not None
    assert found.kind == {"armbian": ARMBIAN, "uenv": UENV, "extlinux": EXTLINUX}[board]
    assert found.cma_bytes == (256 * MiB if board == "armbian" else None)
    assert kernelargs.has_root(found.args)


def test_read_boot_args_cma_with_placement(tmp_path: Path) -> None:
    write(tmp_path, "boot/uEnv.txt", "bootargs=root=/dev/a cma=128M@0-4G\n")
    found = bootfiles.read_boot_args(tmp_path)
    assert found is not None and found.cma_bytes == 128 * MiB
    assert found.value("cma") == "128M@0-4G"


def test_read_boot_args_none_when_no_boot_file(tmp_path: Path) -> None:
    assert bootfiles.read_boot_args(tmp_path) is None
    assert bootfiles.read_boot_args(tmp_path, "/boot/armbianEnv.txt") is None


def test_read_boot_args_errors(tmp_path: Path) -> None:
    write(tmp_path, "boot/armbianEnv.txt", b"rootdev=\xff\xfe\n")
    with pytest.raises(BootFileError, match="not UTF-8"):
        bootfiles.read_boot_args(tmp_path)
    with pytest.raises(BootFileError, match="unknown boot file"):
        bootfiles.read_boot_args(tmp_path, "/boot/config.txt")
    (tmp_path / "boot/armbianEnv.txt").unlink()
    (tmp_path / "boot/armbianEnv.txt").mkdir()
    with pytest.raises(HostReadError):
        bootfiles.read_boot_args(tmp_path, "/boot/armbianEnv.txt")
