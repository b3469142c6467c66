"""Device memory of a llama-server on lavapipe, measured from outside the process.

Lavapipe (Mesa's CPU Vulkan driver) has one memory heap and its device memory
is ordinary anonymous memory of the process: ``vkAllocateMemory`` is a
``malloc`` in Mesa 22.3 (``llvmpipe_allocate_memory``), so it shows up in the
engine's RssAnon, its cgroup and its commit charge, never as a DMA-BUF or
shmem. What is device memory and what is host memory can then only be told
apart by which allocation a page belongs to. So:

* ``vkmemlog.so`` (``vkmemlog.c`` beside this file, built here with the
  system C compiler) is preloaded into the engine and logs every
  ``vkAllocateMemory`` / ``vkMapMemory`` / ``vkFreeMemory`` with its size and,
  once mapped (every lavapipe memory type is host-visible, and llama.cpp maps
  each buffer), its address;
* :class:`DeviceMemory` replays that log: the bytes allocated now and at peak
  (imported host pointers, ``VK_EXT_external_memory_host``, are the host's own
  memory and are not counted), and the bytes of those ranges resident now,
  read from ``/proc/PID/pagemap`` (bit 63: present);
* the host side is then RssAnon minus the resident device bytes.

On a real unified-memory board the device side is the driver's (nvmap, kbase,
shmem GEM objects) and is allocated in full when llama.cpp allocates it, which
is what the allocated column is; the resident column is what lavapipe touched.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIM_SOURCE = HERE / "vkmemlog.c"
PAGE = 4096


def build_shim(out_dir: Path) -> Path:
    """Compile vkmemlog.so into ``out_dir`` (cc and the Vulkan headers are needed)."""
    out = out_dir / "vkmemlog.so"
    subprocess.run(
        ["cc", "-O2", "-Wall", "-shared", "-fPIC", "-o", str(out), str(SHIM_SOURCE), "-ldl"],
        check=True,
    )
    return out


@dataclass
class _Alloc:
    size: int
    imported: bool
    addr: int | None = None
    mapped: int = 0


@dataclass
class DeviceMemory:
    """The live allocations of one process, from its vkmemlog file."""

    log: Path
    allocs: dict[str, _Alloc] = field(default_factory=dict)
    peak_allocated: int = 0
    peak_resident: int = 0
    calls: int = 0
    _offset: int = 0

    def update(self) -> None:
        """Replay the lines written since the last call."""
        try:
            with self.log.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a line being written is read next time
        self._offset += end
        for line in data[:end].decode("ascii", "replace").splitlines():
            self._apply(line.split())
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def _apply(self, f: list[str]) -> None:
        self.calls += 1
        if f[:1] == ["A"] and len(f) == 5:
            self.allocs[f[1]] = _Alloc(int(f[2]), f[4] == "1")
        elif f[:1] == ["M"] and len(f) == 4 and f[1] in self.allocs:
            a = self.allocs[f[1]]
            a.addr, a.mapped = int(f[2], 16), int(f[3])
        elif f[:1] == ["F"] and len(f) == 2:
            self.allocs.pop(f[1], None)

    @property
    def allocated(self) -> int:
        return sum(a.size for a in self.allocs.values() if not a.imported)

    @property
    def count(self) -> int:
        return sum(1 for a in self.allocs.values() if not a.imported)

    def resident(self, pid: int) -> int:
        """Bytes of the mapped, non-imported allocations present in ``pid``'s memory."""
        present = 0
        try:
            with open(f"/proc/{pid}/pagemap", "rb") as pm:
                for a in self.allocs.values():
                    if a.imported or a.addr is None:
                        continue
                    size = a.mapped if 0 < a.mapped < (1 << 62) else a.size
                    first, last = a.addr // PAGE, (a.addr + size + PAGE - 1) // PAGE
                    pm.seek(first * 8)
                    raw = pm.read((last - first) * 8)
                    present += sum(
                        1 for i in range(7, len(raw), 8) if raw[i] & 0x80
                    )  # bit 63 of each little-endian entry
        except OSError:
            return 0
        resident = present * PAGE
        self.peak_resident = max(self.peak_resident, resident)
        return resident
