"""Kernel log records from ``/dev/kmsg`` and the OOM-kill reports inside them.

Owns, from pure to I/O: the record format of Documentation/ABI/testing/dev-kmsg
(:func:`parse_record`: ``pri,seq,ts_usec,flags[,...];message`` with `` KEY=value``
continuation lines, ``\\xNN`` escapes decoded); :class:`OomAssembler`, which turns a
stream of records into one :class:`OomKill` per killed process whatever the kernel
version wrote (4.x to 6.x); and :class:`KmsgReader`, which reads ``/dev/kmsg``
non-blocking after a saved sequence number and counts the records the ring buffer
overwrote as lost, never skipping them silently (under a test root, a regular file in
the same text format stands in for the device). It does not decide what a kill means
(``slmguard.watch.rules``) nor where the cursor is stored (``slmguard.watch.state``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from slmguard.errors import HostReadError
from slmguard.host import files
from slmguard.host.files import ROOT

KMSG = "dev/kmsg"
BOOT_ID = "proc/sys/kernel/random/boot_id"

# One read() returns one record; a buffer shorter than the record fails with
# EINVAL. Records are at most CONSOLE_EXT_LOG_MAX (8 KiB) since Linux 3.5.
_READ_SIZE = 16384

_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")


@dataclass(frozen=True)
class KmsgRecord:
    """One /dev/kmsg record. ``ts_usec`` is the kernel's local_clock at printk time."""

    seq: int
    ts_usec: int
    level: int  # 0 emerg .. 7 debug
    facility: int  # 0 kernel, 1 user (writes to /dev/kmsg) ...
    flags: str  # "-" normal, "c" continuation start, "+" fragment (kernels < 4.9)
    message: str
    fields: Mapping[str, str] = field(default_factory=dict)


def _unescape(text: str) -> str:
    if "\\x" not in text:
        return text
    raw = _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), text)
    # The escaped bytes were UTF-8 sequences; re-decode them as such.
    try:
        return raw.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return raw


def parse_record(text: str) -> KmsgRecord:
    """Parse one record (its first line plus optional `` KEY=value`` lines).

    Raises ValueError when the prefix is not ``pri,seq,ts_usec,flags;``.
    """
    first, _, rest = text.partition("\n")
    prefix, sep, message = first.partition(";")
    if not sep:
        raise ValueError(f"no ';' after the record prefix: {first[:60]!r}")
    parts = prefix.split(",")
    if len(parts) < 3:
        raise ValueError(f"record prefix has {len(parts)} fields, expected >= 3: {prefix!r}")
    try:
        pri, seq, ts_usec = int(parts[0]), int(parts[1]), int(parts[2])
    except ValueError as err:
        raise ValueError(f"record prefix is not numeric: {prefix!r}") from err
    flags = parts[3] if len(parts) > 3 else "-"
    fields: dict[str, str] = {}
    for line in rest.splitlines():
        if line.startswith(" ") and "=" in line:
            key, _, value = line[1:].partition("=")
            fields[key] = _unescape(value)
    return KmsgRecord(
        seq=seq,
        ts_usec=ts_usec,
        level=pri & 7,
        facility=pri >> 3,
        flags=flags,
        message=_unescape(message),
        fields=fields,
    )


def parse_records(text: str) -> list[KmsgRecord]:
    """Parse a dump of records (one per line, continuation lines start with a space).

    Lines that are not records are skipped, so a truncated capture yields the
    records that were complete.
    """
    out: list[KmsgRecord] = []
    chunk: list[str] = []

    def flush() -> None:
        if chunk:
            with contextlib.suppress(ValueError):
                out.append(parse_record("\n".join(chunk)))
            chunk.clear()

    for line in text.splitlines():
        if line.startswith(" ") and chunk:
            chunk.append(line)
        else:
            flush()
            chunk.append(line)
    flush()
    return out


# ---------------------------------------------------------------- OOM reports

_INVOKED = re.compile(r"^(?P<comm>.*?) invoked oom-killer:")
# comm is at most 15 bytes but may itself contain ") " or spaces; the victim's
# fields follow the closing parenthesis.
_KILLED = re.compile(
    r"^(?:(?P<reason>[^:]*?(?:out of memory|Out of memory)[^:]*?): )?"
    r"Killed process (?P<pid>\d+) \((?P<comm>.*?)\)(?P<rest>(?: total-vm:.*)?)$"
)
_SACRIFICE = re.compile(
    r"^(?P<reason>.*?): Kill process (?P<pid>\d+) \((?P<comm>.*?)\) score (?P<score>\d+)"
)
_OOM_KILL = re.compile(r"^oom-kill:(?P<kv>.*)$")
_TASK_IN = re.compile(r"^Task in (?P<task>\S+) killed as a result of limit of (?P<limit>\S+)")
_GROUP = re.compile(r"^Tasks in (?P<memcg>\S+) are going to be killed due to memory\.oom\.group")
_FIELD = re.compile(r"(?P<key>[A-Za-z_-]+):(?P<value>-?\d+)(?P<kb>kB)?")
_KV_SPLIT = re.compile(r",(?=[a-z_]+=)")


def parse_oom_kill_line(text: str) -> dict[str, str]:
    """``constraint=...,nodemask=...,oom_memcg=...,task=...,pid=...`` -> dict."""
    out: dict[str, str] = {}
    for item in _KV_SPLIT.split(text):
        key, sep, value = item.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


@dataclass(frozen=True)
class OomKill:
    """One process killed by the kernel OOM killer, as its report described it.

    ``scope`` is ``"memcg"`` when a memory cgroup hit its limit and ``"system"``
    when the whole machine (or a cpuset/mempolicy) ran out; ``constraint`` is
    the kernel's own word (``CONSTRAINT_MEMCG``, ``CONSTRAINT_NONE``, ...) when
    it printed one (4.19+). Memory cgroup paths are as the kernel prints them:
    relative to the hierarchy root, starting with ``/``.
    """

    seq: int
    ts_usec: int
    pid: int
    comm: str
    scope: str  # "memcg" | "system"
    first_seq: int
    constraint: str | None = None
    oom_memcg: str | None = None
    task_memcg: str | None = None
    uid: int | None = None
    total_vm_bytes: int | None = None
    anon_rss_bytes: int | None = None
    file_rss_bytes: int | None = None
    shmem_rss_bytes: int | None = None
    oom_score_adj: int | None = None
    invoked_by: str | None = None
    lines: tuple[str, ...] = ()

    @property
    def rss_bytes(self) -> int | None:
        parts = (self.anon_rss_bytes, self.file_rss_bytes, self.shmem_rss_bytes)
        if all(p is None for p in parts):
            return None
        return sum(p or 0 for p in parts)

    def in_cgroup(self, kernel_path: str) -> bool:
        """True when the victim's memory cgroup is ``kernel_path`` or below it."""
        wanted = "/" + kernel_path.strip("/")
        for path in (self.task_memcg, self.oom_memcg):
            if path is None:
                continue
            path = "/" + path.strip("/")
            if wanted == "/" or path == wanted or path.startswith(wanted + "/"):
                return True
        return False


def _scope(reason: str | None, constraint: str | None) -> str:
    if constraint is not None:
        return "memcg" if constraint == "CONSTRAINT_MEMCG" else "system"
    if reason and reason.lower().startswith("memory cgroup"):
        return "memcg"
    return "system"


@dataclass
class _Report:
    start_seq: int
    start_ts_usec: int
    invoked_by: str | None
    lines: list[str]
    records: int = 0
    kv: dict[str, str] = field(default_factory=dict)
    task_in: tuple[str, str] | None = None
    group_memcg: str | None = None
    reason: str | None = None
    killed: set[int] = field(default_factory=set)


class OomAssembler:
    """Feed records in sequence order; get back each OOM kill once.

    What each kernel writes:

    - 6.x and 5.x: ``<comm> invoked oom-killer: ...``, the memory report,
      ``oom-kill:constraint=...,oom_memcg=...,task_memcg=...,task=...,pid=...,uid=...``
      then ``Memory cgroup out of memory: Killed process <pid> (<comm>) total-vm:..kB,
      anon-rss:..kB, file-rss:..kB, shmem-rss:..kB, UID:.. pgtables:..kB oom_score_adj:..``
      (``Out of memory: Killed process`` for a system-wide OOM).
    - 4.19 to early 5.x: the same ``oom-kill:`` line, but the kill is announced as
      ``<reason>: Kill process <pid> (<comm>) score <n> or sacrifice child`` and the
      victim (possibly a child with another pid) follows as ``Killed process ...``
      without a reason prefix and without UID/pgtables.
    - before 4.19: no ``oom-kill:`` line; the memory cgroup comes from
      ``Task in <task memcg> killed as a result of limit of <oom memcg>``.

    ``oom_reaper: reaped process`` lines are not kills and are ignored.

    A report starts at ``invoked oom-killer`` and ends at a ``Killed process``
    line. While a report is open, :attr:`safe_cursor` stays just before its
    first record, so a watcher that restarts mid-report reads it again whole.
    A report that never reaches a kill (the victim was already exiting) is
    dropped when the next one starts or when it is older than ``max_age_s``
    or longer than ``max_lines``.
    """

    def __init__(self, *, max_lines: int = 4000, max_age_s: float = 30.0) -> None:
        self.max_lines = max_lines
        self.max_age_s = max_age_s
        self._report: _Report | None = None
        self._context: _Report | None = None

    @property
    def pending_since_seq(self) -> int | None:
        return self._report.start_seq if self._report else None

    def safe_cursor(self, cursor: int | None) -> int | None:
        """The cursor that may be saved: before an open report, else ``cursor``."""
        if self._report is not None:
            before = self._report.start_seq - 1
            return before if cursor is None else min(cursor, before)
        return cursor

    def expire(self, now_ts_usec: int) -> None:
        """Drop an open report older than ``max_age_s`` on the kernel clock."""
        report = self._report
        if report and now_ts_usec - report.start_ts_usec > self.max_age_s * 1e6:
            self._report = None

    def feed(self, record: KmsgRecord) -> list[OomKill]:
        msg = record.message
        if invoked := _INVOKED.match(msg):
            self._report = _Report(record.seq, record.ts_usec, invoked.group("comm"), [])
            self._context = None
        report = self._report
        if report is not None:
            report.records += 1
            if len(report.lines) < self.max_lines:
                report.lines.append(msg)
            if report.records > self.max_lines * 4:
                self._report = report = None
        if "oom" not in msg and "Kill" not in msg and "Task" not in msg:
            return []
        m = _KILLED.match(msg)
        if report is None:
            context = self._context
            fresh = (
                context is not None
                and record.ts_usec - context.start_ts_usec <= self.max_age_s * 1e6
            )
            if fresh and context is not None and (g := _GROUP.match(msg)):
                context.group_memcg = g.group("memcg")
                context.lines.append(msg)
                return []
            if m and fresh and context is not None:
                # Group kills (memory.oom.group) print more "Killed process"
                # lines after the first: same report, same context. The first
                # victim can be printed twice (killed, then met again by the
                # group scan while still exiting): one kill per pid.
                if int(m.group("pid")) in context.killed:
                    return []
                context.lines.append(msg)
                context.killed.add(int(m.group("pid")))
                return [self._build(record, context, m)]
            if not (m or _OOM_KILL.match(msg) or _TASK_IN.match(msg) or _SACRIFICE.match(msg)):
                return []
            # The header was lost (ring buffer wrap, watcher started mid-report).
            report = _Report(record.seq, record.ts_usec, None, [msg], records=1)
            self._report = report
        if m:
            kill = self._build(record, report, m)
            report.killed.add(kill.pid)
            self._report = None
            self._context = report
            return [kill]
        if o := _OOM_KILL.match(msg):
            report.kv = parse_oom_kill_line(o.group("kv"))
        elif t := _TASK_IN.match(msg):
            report.task_in = (t.group("task"), t.group("limit"))
        elif g := _GROUP.match(msg):
            report.group_memcg = g.group("memcg")
        elif s := _SACRIFICE.match(msg):
            report.reason = s.group("reason")
        return []

    def _build(self, record: KmsgRecord, report: _Report, m: re.Match[str]) -> OomKill:
        pid = int(m.group("pid"))
        values: dict[str, int] = {}
        for f in _FIELD.finditer(m.group("rest")):
            scale = 1024 if f.group("kb") else 1
            values[f.group("key")] = int(f.group("value")) * scale
        kv = report.kv
        same_task = kv.get("pid") == str(pid)
        constraint = kv.get("constraint")
        oom_memcg = kv.get("oom_memcg")
        task_memcg = kv.get("task_memcg") if same_task else None
        uid: int | None = values.get("UID")
        if uid is None and same_task and kv.get("uid", "").lstrip("-").isdigit():
            uid = int(kv["uid"])
        if report.task_in is not None:
            task_memcg = task_memcg or report.task_in[0]
            oom_memcg = oom_memcg or report.task_in[1]
        if report.group_memcg is not None:
            task_memcg = task_memcg or report.group_memcg
            oom_memcg = oom_memcg or report.group_memcg
        reason = m.group("reason") or report.reason
        return OomKill(
            seq=record.seq,
            ts_usec=record.ts_usec,
            pid=pid,
            comm=m.group("comm"),
            scope=_scope(reason, constraint),
            first_seq=report.start_seq,
            constraint=constraint,
            oom_memcg=oom_memcg,
            task_memcg=task_memcg,
            uid=uid,
            total_vm_bytes=values.get("total-vm"),
            anon_rss_bytes=values.get("anon-rss"),
            file_rss_bytes=values.get("file-rss"),
            shmem_rss_bytes=values.get("shmem-rss"),
            oom_score_adj=values.get("oom_score_adj"),
            invoked_by=report.invoked_by,
            lines=tuple(report.lines),
        )


def find_oom_kills(records: Iterable[KmsgRecord]) -> list[OomKill]:
    """All kills in a finished sequence of records (a capture, a test fixture)."""
    assembler = OomAssembler()
    kills: list[OomKill] = []
    for record in records:
        kills.extend(assembler.feed(record))
    return kills


# ---------------------------------------------------------------- reader


@dataclass(frozen=True)
class KmsgBatch:
    """What one read returned: records after the cursor, and how many were lost."""

    records: tuple[KmsgRecord, ...]
    lost: int  # records overwritten before they could be read
    last_seq: int | None  # the newest sequence number seen (the next cursor)


def read_boot_id(root: Path = ROOT) -> str | None:
    """This boot's id; sequence numbers restart at every boot."""
    text = files.read(root / BOOT_ID).text
    return text.strip() or None if text is not None else None


class KmsgReader:
    """A non-blocking reader of ``root/dev/kmsg`` that resumes after a cursor.

    ``cursor`` is the last sequence number already handled (None: nothing yet,
    start from the oldest record still in the ring buffer). There is no seek to a
    sequence number, so it reads from the oldest record and skips up to the cursor;
    records overwritten since the cursor (EPIPE while reading, or a first record newer
    than cursor + 1) are counted as lost. Use as a context manager or call :meth:`close`.
    """

    def __init__(self, root: Path = ROOT, cursor: int | None = None) -> None:
        self.path = root / KMSG
        self.cursor = cursor
        self._fd: int | None = None
        self._is_device = False
        self._file_offset = 0

    def __enter__(self) -> KmsgReader:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_device(self) -> bool:
        """True for the real character device (poll() on it waits for new records)."""
        self.fileno()
        return self._is_device

    def fileno(self) -> int:
        """The open descriptor (poll() reports POLLIN when new records arrive)."""
        if self._fd is None:
            self.open()
        assert self._fd is not None  # for mypy: open() set it or raised
        return self._fd

    def open(self) -> None:
        if self._fd is not None:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError as err:
            raise HostReadError(self.path, "missing (no /dev/kmsg in this container?)") from err
        except PermissionError as err:
            raise HostReadError(
                self.path,
                "permission denied (needs root or CAP_SYSLOG, or kernel.dmesg_restrict=0)",
            ) from err
        except OSError as err:
            raise HostReadError(self.path, err.strerror or str(err)) from err
        self._fd = fd
        self._is_device = stat.S_ISCHR(os.fstat(fd).st_mode)
        if self._is_device:
            # SEEK_SET on /dev/kmsg means "the oldest record still buffered".
            os.lseek(fd, 0, os.SEEK_SET)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _file_records(self, fd: int) -> list[KmsgRecord]:
        """A test root's regular file: the whole lines appended since the last read."""
        os.lseek(fd, self._file_offset, os.SEEK_SET)
        data = b""
        while chunk := os.read(fd, 65536):
            data += chunk
        end = data.rfind(b"\n") + 1  # a writer may be appending
        self._file_offset += end
        return parse_records(data[:end].decode("utf-8", errors="replace"))

    def _device_records(self, fd: int) -> list[KmsgRecord]:
        """The records available now; each read() returns exactly one."""
        records: list[KmsgRecord] = []
        while True:
            try:
                data = os.read(fd, _READ_SIZE)
            except BlockingIOError:
                break
            except BrokenPipeError:
                # The record we were about to read was overwritten; the kernel
                # moved us to the oldest one left. The sequence gap says how many.
                continue
            except InterruptedError:
                continue
            except OSError as err:
                if err.errno == errno.EAGAIN:
                    break
                raise HostReadError(self.path, err.strerror or str(err)) from err
            if not data:
                break
            with contextlib.suppress(ValueError):
                records.append(parse_record(data.decode("utf-8", errors="replace").rstrip("\n")))
        return records

    def read(self) -> KmsgBatch:
        """Records newer than the cursor; advances the cursor past them."""
        fd = self.fileno()
        available = self._device_records(fd) if self._is_device else self._file_records(fd)
        records: list[KmsgRecord] = []
        lost = 0
        expected = None if self.cursor is None else self.cursor + 1
        for record in available:
            if self.cursor is not None and record.seq <= self.cursor:
                continue
            if expected is not None and record.seq > expected:
                lost += record.seq - expected
            expected = record.seq + 1
            self.cursor = record.seq
            records.append(record)
        return KmsgBatch(records=tuple(records), lost=lost, last_seq=self.cursor)
