"""A board's storage for weeks: the journal's size, ``noatime``; pure text (issue 40).

An SD card or eMMC wears by the block, and a board writes for weeks. ``render`` and
``apply`` offer the usual board settings, each opt-in (``--journal``, ``--noatime``):

- **the journal** (:func:`journald_conf`, a drop-in at :data:`JOURNALD_DROPIN`):
  ``capped`` keeps it on disk within 64 MiB (``SystemMaxUse=``, files of 8 MiB, a
  month at most), ``volatile`` keeps it in RAM only (``Storage=volatile``, 32 MiB;
  lost at reboot: the state on tmpfs for what may be lost), ``keep`` writes nothing.
  Rate limits are journald's own defaults and the server's engine lines are already
  rate-limited; a drop-in, not ``journald.conf`` itself, so rollback removes it whole.
- **noatime** (:func:`add_noatime`): the fstab lines mounting ``/``, ``/var`` or
  ``/var/lib`` (where the state directory lives) get ``noatime`` in place of
  ``relatime``/``strictatime``/``atime``: a read never becomes a write. Takes effect at
  the next mount (reboot, or ``mount -o remount /``). Other lines, comments and the
  file's bytes otherwise are kept.

``doctor`` checks both (:mod:`slmguard.doctor.storage`). No I/O here.
"""

from __future__ import annotations

JOURNALD_DROPIN = "/etc/systemd/journald.conf.d/50-slmguard.conf"
JOURNAL_MODES = ("keep", "capped", "volatile")
#: Mount points whose atime updates would be the state directory's writes.
NOATIME_MOUNTS = ("/", "/var", "/var/lib")
_ATIME_OPTIONS = {"relatime", "strictatime", "atime", "norelatime", "lazytime"}
#: Filesystems whose atime the kernel writes to the device.
_DISK_FS = {"ext2", "ext3", "ext4", "f2fs", "xfs", "btrfs", "vfat", "exfat"}

_JOURNALD = {
    "capped": (
        "# slmguard apply --journal capped: the journal on disk within 64 MiB (an SD card\n"
        "# wears by the block). Remove this file, or `slmguard rollback`, to undo.\n"
        "[Journal]\nStorage=persistent\nSystemMaxUse=64M\nSystemMaxFileSize=8M\n"
        "MaxRetentionSec=1month\nSyncIntervalSec=5m\n"
    ),
    "volatile": (
        "# slmguard apply --journal volatile: the journal in RAM only, lost at reboot (no\n"
        "# writes to the SD card). Remove this file, or `slmguard rollback`, to undo.\n"
        "[Journal]\nStorage=volatile\nRuntimeMaxUse=32M\nRuntimeMaxFileSize=4M\n"
    ),
}


def journald_conf(mode: str) -> str | None:
    """The drop-in's text for ``mode`` (None for ``keep``: nothing written)."""
    if mode not in JOURNAL_MODES:
        raise ValueError(f"journal mode {mode!r}: one of {', '.join(JOURNAL_MODES)}")
    return _JOURNALD.get(mode)


def _with_noatime(options: str) -> str:
    kept = [o for o in options.split(",") if o and o not in _ATIME_OPTIONS and o != "noatime"]
    if kept == ["defaults"] or not kept:
        return "defaults,noatime"
    return ",".join([*kept, "noatime"])


def add_noatime(text: str) -> str:
    """``text`` (an fstab) with ``noatime`` on the lines mounting :data:`NOATIME_MOUNTS`
    from a disk filesystem; every other byte kept (whitespace between fields too)."""
    out = []
    for line in text.splitlines(keepends=True):
        fields = line.split()
        if (
            len(fields) >= 4
            and not fields[0].startswith("#")
            and fields[1] in NOATIME_MOUNTS
            and fields[2] in _DISK_FS
            and "noatime" not in fields[3].split(",")
        ):
            start = _field_start(line, 3)
            end = start + len(fields[3])
            line = line[:start] + _with_noatime(fields[3]) + line[end:]
        out.append(line)
    return "".join(out)


def _field_start(line: str, index: int) -> int:
    """Where the ``index``-th whitespace-separated field of ``line`` starts."""
    pos, seen = 0, -1
    while pos < len(line):
        while pos < len(line) and line[pos] in " \t":
            pos += 1
        seen += 1
        if seen == index:
            return pos
        while pos < len(line) and line[pos] not in " \t\n":
            pos += 1
    return pos
