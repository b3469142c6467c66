"""Doctor checks that the board's storage will last weeks of writes (issue 40).

Owns ``storage.noatime`` (the filesystem holding the state directory, /var/lib/slmguard,
is mounted ``noatime``, or lives in RAM: otherwise reads turn into writes) and
``storage.journal`` (journald keeps its log in RAM, or on disk within a cap of at most
256 MiB: its default takes up to 10% of the filesystem, 4 GiB at most, and writes every
line to the card). Both are warnings with the fix: ``slmguard apply --noatime`` and
``--journal capped|volatile`` (:mod:`slmguard.deploy.storage`). Pure: reads only the
snapshot.
"""

from __future__ import annotations

from slmguard.doctor.findings import CheckId, Evidence, Finding
from slmguard.host.snapshot import HostSnapshot, Unread
from slmguard.host.storage import STATE_DIR, StorageFacts
from slmguard.plan.schema import Plan

#: A journal on disk capped at or below this is an SD card's budget.
JOURNAL_CAP_BYTES = 256 << 20
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def journald_bytes(value: str | None) -> int | None:
    """journald.conf(5) sizes: bytes with an optional K/M/G/T suffix (powers of 1024)."""
    if not value:
        return None
    text = value.strip().upper().removesuffix("B")
    factor = _UNITS.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in _UNITS else text
    return int(digits) * factor if digits.isdigit() else None


def _facts(s: HostSnapshot) -> StorageFacts | Unread | None:
    return s.storage


def check_noatime(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("storage.noatime", "The state directory's filesystem is mounted noatime")
    facts = _facts(s)
    if isinstance(facts, Unread):
        return check.unread(facts)
    if facts is None or facts.state_mount is None:
        return check.unknown("the mounts were not read")
    m = facts.state_mount
    ev = [Evidence(f"mount holding {STATE_DIR}",
                   f"{m.mount_point} ({m.fstype}, {','.join(m.options)})",
                   str(s.root / "proc/self/mountinfo"))]  # fmt: skip
    if m.in_memory:
        return check.passed(f"{m.mount_point} is {m.fstype}: nothing reaches the card", ev)
    if "noatime" in m.options:
        return check.passed(f"{m.mount_point} is mounted noatime", ev)
    atime = "relatime" if "relatime" in m.options else "atime"
    return check.warn(
        f"{m.mount_point} ({m.fstype}) is mounted {atime}: reading the state and the model "
        "writes their access times to the card",
        ev,
        "slmguard apply --noatime (adds noatime to its /etc/fstab line; from the next mount), "
        f"or now: mount -o remount,noatime {m.mount_point}",
    )


def check_journal(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("storage.journal", "The journal is in RAM or capped on disk")
    facts = _facts(s)
    if isinstance(facts, Unread):
        return check.unread(facts)
    if facts is None:
        return check.unknown("journald's settings were not read")
    j = facts.journald
    where = ", ".join(j.files) or "no journald.conf: journald's defaults"
    ev = [Evidence("Storage / SystemMaxUse / RuntimeMaxUse",
                   f"{j.storage or 'auto'} / {j.system_max_use or 'default'} / "
                   f"{j.runtime_max_use or 'default'}", where)]  # fmt: skip
    storage = (j.storage or "auto").lower()
    if storage in ("volatile", "none"):
        return check.passed(f"the journal is {storage}: it writes nothing to the card", ev)
    cap = journald_bytes(j.system_max_use)
    if cap is not None and cap <= JOURNAL_CAP_BYTES:
        return check.passed(f"the journal on disk is capped at {j.system_max_use}", ev)
    return check.warn(
        "the journal on disk is not capped for an SD card (journald's default: up to 10% of "
        "the filesystem, 4 GiB at most, every line written to the card)",
        ev,
        "slmguard apply --journal capped (64 MiB on disk) or --journal volatile (in RAM, "
        "lost at reboot)",
    )
