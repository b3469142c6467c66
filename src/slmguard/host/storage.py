"""The storage a board's state directory and journal live on (issue 40: an SD card wears).

Owns two reads for ``doctor``'s storage checks:

- ``/proc/self/mountinfo`` (proc(5): mount ID, parent, major:minor, root, mount point,
  per-mount options, optional fields, ``-``, type, source, super options): the mount
  holding a path (the longest mount point that is a prefix of it), with its type and its
  options, per-mount and super block together (``noatime`` is per-mount since 2.6.20).
- journald's settings: ``etc/systemd/journald.conf`` then the drop-ins of
  ``etc/systemd/journald.conf.d/*.conf`` in name order, later ones winning
  (journald.conf(5)): ``Storage=``, ``SystemMaxUse=``, ``RuntimeMaxUse=``.

Pure parsers plus a reader that takes a root path; it changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slmguard.host import files
from slmguard.host.files import ROOT

MOUNTINFO = "proc/self/mountinfo"
JOURNALD_CONF = "etc/systemd/journald.conf"
JOURNALD_DROPINS = "etc/systemd/journald.conf.d"
#: Where the service keeps its state (StateDirectory=slmguard), as doctor checks it.
STATE_DIR = "/var/lib/slmguard"


@dataclass(frozen=True)
class Mount:
    mount_point: str
    fstype: str
    source: str
    options: tuple[str, ...]  # per-mount options, then the super block's

    @property
    def in_memory(self) -> bool:
        """tmpfs or ramfs: nothing written here reaches a card."""
        return self.fstype in ("tmpfs", "ramfs")


@dataclass(frozen=True)
class Journald:
    """journald's settings as its files say (None: not set, journald's default)."""

    storage: str | None = None  # volatile | persistent | auto | none
    system_max_use: str | None = None
    runtime_max_use: str | None = None
    files: tuple[str, ...] = ()  # the files read, in order


@dataclass(frozen=True)
class StorageFacts:
    state_mount: Mount | None  # the mount holding STATE_DIR (None: not in mountinfo)
    journald: Journald


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> tuple[Mount, ...]:
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 6 or len(tail) < 2:
            continue  # malformed: skipped
        supers = tuple(tail[2].split(",")) if len(tail) > 2 else ()
        options = (*fields[5].split(","), *supers)
        mounts.append(Mount(_unescape(fields[4]), tail[0], _unescape(tail[1]), options))
    return tuple(mounts)


def mount_for(mounts: tuple[Mount, ...], path: str) -> Mount | None:
    """The mount holding ``path``: the longest mount point on its way (the last mounted
    of equal ones, as the kernel stacks them)."""
    best: tuple[int, Mount] | None = None
    for m in mounts:
        point = m.mount_point.rstrip("/") or "/"
        holds = point == "/" or path == point or path.startswith(point + "/")
        if holds and (best is None or len(point) >= best[0]):
            best = (len(point), m)
    return None if best is None else best[1]


def parse_journald(texts: list[tuple[str, str]]) -> Journald:
    """journald's settings from ``(name, text)`` files in the order journald reads them."""
    found: dict[str, str] = {}
    section = None
    for _, text in texts:
        section = None
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                continue
            key, sep, value = line.partition("=")
            if sep and section == "Journal":
                found[key.strip()] = value.strip()
    return Journald(
        storage=found.get("Storage"),
        system_max_use=found.get("SystemMaxUse"),
        runtime_max_use=found.get("RuntimeMaxUse"),
        files=tuple(name for name, _ in texts),
    )


def read_storage(root: Path = ROOT, state_dir: str = STATE_DIR) -> StorageFacts:
    """The state directory's mount and journald's settings under ``root``; raises
    HostReadError when mountinfo cannot be read (a missing journald.conf is its defaults)."""
    mounts = parse_mountinfo(files.read(root / MOUNTINFO).require())
    texts = []
    conf = files.read(root / JOURNALD_CONF).optional()
    if conf is not None:
        texts.append((f"/{JOURNALD_CONF}", conf))
    dropins = root / JOURNALD_DROPINS
    if dropins.is_dir():
        for path in sorted(dropins.glob("*.conf")):
            text = files.read(path).optional()
            if text is not None:  # removed between the listing and the read
                texts.append((f"/{JOURNALD_DROPINS}/{path.name}", text))
    return StorageFacts(mount_for(mounts, state_dir), parse_journald(texts))
