"""DMA-BUF totals: memory the NPU/GPU drivers hold outside any process's RSS.

Two sources, tried in order:

- ``/sys/kernel/debug/dma_buf/bufinfo`` (debugfs, root only): a table of
  buffers ending in ``Total <n> objects, <bytes> bytes`` (drivers/dma-buf/dma-buf.c,
  ``dma_buf_debug_show``). When the total line is missing (truncated read) the
  rows are summed.
- ``/sys/kernel/dmabuf/buffers/<inode>/size`` (CONFIG_DMABUF_SYSFS_STATS,
  Linux 5.13 to 6.x; removed upstream later): one directory per buffer.

DMA-BUF memory is not charged to the exporting process's memory cgroup, so it
is what a cgroup limit does not see.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import HostReadError
from slmguard.host.procfs import ROOT, read_error, read_text

BUFINFO = "sys/kernel/debug/dma_buf/bufinfo"
SYSFS_BUFFERS = "sys/kernel/dmabuf/buffers"


@dataclass(frozen=True)
class DmaBufTotals:
    count: int
    total_bytes: int
    source: Path


def parse_bufinfo(text: str) -> tuple[int, int]:
    """(objects, bytes) from debugfs bufinfo. Raises ValueError when nothing parses."""
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


def read_dmabuf_totals(root: Path = ROOT) -> DmaBufTotals:
    """Totals from debugfs, else sysfs stats; HostReadError when neither is readable."""
    first_problem: HostReadError | None = None
    try:
        text = read_text(root, BUFINFO)
    except HostReadError as err:
        first_problem = err
    else:
        try:
            count, total = parse_bufinfo(text)
        except ValueError as err:
            raise HostReadError(root / BUFINFO, str(err)) from err
        return DmaBufTotals(count, total, root / BUFINFO)
    buffers = root / SYSFS_BUFFERS
    if buffers.is_dir():
        try:
            entries = sorted(buffers.iterdir())
        except OSError as err:
            raise read_error(buffers, err) from err
        count = total = 0
        for entry in entries:
            size_text = read_text(root, f"{SYSFS_BUFFERS}/{entry.name}/size").strip()
            try:
                total += int(size_text)
            except ValueError as err:
                raise HostReadError(entry / "size", f"not an integer: {size_text!r}") from err
            count += 1
        return DmaBufTotals(count, total, buffers)
    raise HostReadError(
        root / BUFINFO,
        f"{first_problem.problem}; and no /{SYSFS_BUFFERS}",
    )
