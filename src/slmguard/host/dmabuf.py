"""DMA-BUF totals: memory the NPU/GPU drivers hold outside any process's RSS and cgroup.

Owns the one system-wide total, so the doctor's audit and the watcher's polls cannot
disagree on one board. Two sources, in this order: debugfs's
``/sys/kernel/debug/dma_buf/bufinfo`` (root only; one consistent count) and, without it,
the per-buffer ``/sys/kernel/dmabuf/buffers/<inode>/size`` (CONFIG_DMABUF_SYSFS_STATS,
Linux 5.13+, readable without root; see :func:`read_dmabuf_totals` for why it comes
second). Where both exist they differ only by the buffers made or freed between the two
reads. DMA-BUF memory is not charged to the exporting process's memory cgroup. Not a
process's own DMA-BUF fds (:mod:`slmguard.host.process`). Nothing here writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import HostReadError
from slmguard.host import files
from slmguard.host.files import ROOT, read_error

BUFINFO = "sys/kernel/debug/dma_buf/bufinfo"
SYSFS_BUFFERS = "sys/kernel/dmabuf/buffers"


@dataclass(frozen=True)
class DmaBufTotals:
    count: int
    total_bytes: int
    source: Path


def parse_bufinfo(text: str) -> tuple[int, int]:
    """(objects, bytes) from debugfs bufinfo. Raises ValueError when nothing parses.

    ``dma_buf_debug_show`` (drivers/dma-buf/dma-buf.c) prints the table in one pass under
    the buffer list's lock, ending in ``Total <n> objects, <bytes> bytes``; without that
    line (a truncated read) the rows are summed.
    """
    m = re.search(r"^Total\s+(\d+)\s+objects,\s+(\d+)\s+bytes", text, flags=re.MULTILINE)
    if m:
        return int(m.group(1)), int(m.group(2))
    count = total = 0
    in_table = False
    for line in text.splitlines():
        fields = line.split()
        if fields[:1] == ["size"]:
            in_table = True
            continue
        # Buffer rows start with the zero-padded size then hex flags and mode.
        if in_table and len(fields) >= 4 and fields[0].isdigit():
            count += 1
            total += int(fields[0])
    if not in_table:
        raise ValueError("no buffer table and no Total line")
    return count, total


def _read_sysfs_totals(root: Path) -> DmaBufTotals | None:
    """Totals from the sysfs stats; None when the kernel has none."""
    buffers = root / SYSFS_BUFFERS
    if not buffers.is_dir():
        return None
    try:
        entries = sorted(buffers.iterdir())
    except OSError as err:
        raise read_error(buffers, err) from err
    count = total = 0
    for entry in entries:
        size_text = files.read(entry / "size").optional()
        if size_text is None:
            continue  # freed since the listing
        size_text = size_text.strip()
        try:
            total += int(size_text)
        except ValueError as err:
            raise HostReadError(entry / "size", f"not an integer: {size_text!r}") from err
        count += 1
    return DmaBufTotals(count, total, buffers)


def read_dmabuf_totals(root: Path = ROOT) -> DmaBufTotals:
    """Totals from debugfs, else the sysfs stats; HostReadError when neither is readable.

    The sysfs stats are the fallback: walking them is one read per buffer while buffers
    come and go (one freed during the walk is skipped), and the option is deprecated for
    its cost on every export (commit e0a9f1fe206a) and removed upstream after the 6.18
    LTS, so new kernels have only debugfs.
    """
    try:
        text = files.read(root / BUFINFO).require()
    except HostReadError as err:
        totals = _read_sysfs_totals(root)
        if totals is None:
            raise HostReadError(root / BUFINFO, f"{err.problem}; and no /{SYSFS_BUFFERS}") from err
        return totals
    try:
        count, total = parse_bufinfo(text)
    except ValueError as err:
        raise HostReadError(root / BUFINFO, str(err)) from err
    return DmaBufTotals(count, total, root / BUFINFO)
