"""A real child memory cgroup for tests: create, limit, run a command inside, remove.

The child is made below this process's own memory cgroup (cgroup v1:
``/sys/fs/cgroup/memory/<own path>/<child>``; v2: ``/sys/fs/cgroup/<own
path>/<child>`` when the memory controller can be enabled there), so tests
never touch cgroups they do not own. Tests that need it are marked ``cgroup``
and skip with :func:`unavailable_reason`.

Example::

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with memory_cgroup(32 << 20) as cg:
        done = cg.run([sys.executable, "-c", HOG])
        assert done.returncode == -9
        cg.read("memory.oom_control")
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from waiting import scaled

CGROUP_MOUNT = Path("/sys/fs/cgroup")

# A program that names itself (comm) and allocates and touches memory until
# killed. argv[1]: comm, argv[2]: MiB to allocate.
HOG = (
    "import sys\n"
    "open('/proc/self/comm', 'w').write(sys.argv[1])\n"
    "chunks = []\n"
    "for _ in range(int(sys.argv[2])):\n"
    "    chunks.append(b'x' * (1 << 20))\n"
    "print('survived', flush=True)\n"
)


@dataclass(frozen=True)
class RealCgroup:
    version: int  # 1 or 2
    path: Path  # the cgroup directory
    kernel_path: str  # the path as the kernel prints it (oom_memcg=..., /proc/PID/cgroup)
    limit_bytes: int

    def read(self, name: str) -> str:
        return (self.path / name).read_text(encoding="utf-8")

    def procs(self) -> list[int]:
        return [int(x) for x in self.read("cgroup.procs").split()]

    def command(self, argv: Sequence[str]) -> list[str]:
        """argv wrapped so that it runs inside this cgroup from its first instruction."""
        return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path), *argv]

    def run(self, argv: Sequence[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(argv),
            capture_output=True,
            text=True,
            timeout=scaled(timeout_s),
            check=False,
        )

    def popen(self, argv: Sequence[str]) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.command(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )


def _own_paths() -> tuple[str | None, str | None]:
    """(v1 memory path, v2 path) of this process from /proc/self/cgroup."""
    v1 = v2 = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        ident, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            v1 = path
        elif ident == "0" and not controllers:
            v2 = path
    return v1, v2


def _parent() -> tuple[int, Path, str] | str:
    """(version, parent dir, parent kernel path) or the reason there is none."""
    if os.geteuid() != 0:
        return "creating a memory cgroup needs root"
    v1, v2 = _own_paths()
    if v1 is not None:
        parent = CGROUP_MOUNT / "memory" / v1.lstrip("/")
        if not (parent / "memory.limit_in_bytes").exists():
            return f"cgroup v1 memory directory {parent} not found"
        return 1, parent, v1
    if v2 is not None:
        parent = CGROUP_MOUNT / v2.lstrip("/")
        controllers = parent / "cgroup.controllers"
        if not controllers.exists() or "memory" not in controllers.read_text().split():
            return f"cgroup v2 memory controller not available in {parent}"
        subtree = parent / "cgroup.subtree_control"
        if "memory" not in subtree.read_text().split():
            try:
                subtree.write_text("+memory")
            except OSError as err:
                return f"cannot enable memory in {subtree}: {err.strerror}"
        return 2, parent, v2
    return "no memory cgroup controller on this host"


def unavailable_reason() -> str | None:
    """Why a real child memory cgroup cannot be made here, or None when it can."""
    found = _parent()
    if isinstance(found, str):
        return found
    _, parent, _ = found
    if not os.access(parent, os.W_OK):
        return f"{parent} is not writable"
    return None


def _remove(path: Path) -> None:
    # The kernel frees a killed cgroup's memory asynchronously: retry until the
    # (scaled) bound, not a fixed number of times.
    deadline = time.monotonic() + scaled(30)
    while time.monotonic() < deadline:
        try:
            pids = [int(x) for x in (path / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"could not remove test cgroup {path}")


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int, prefix: str = "slmguard-test") -> Iterator[RealCgroup]:
    """A fresh child memory cgroup limited to ``limit_bytes``, removed afterwards."""
    found = _parent()
    if isinstance(found, str):
        raise RuntimeError(found)
    version, parent, parent_kernel = found
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    path = parent / name
    path.mkdir()
    try:
        if version == 1:
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            memsw = path / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # no swapping instead of an OOM kill
                memsw.write_text(str(limit_bytes))
        else:
            (path / "memory.max").write_text(str(limit_bytes))
            swap = path / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
        kernel_path = parent_kernel.rstrip("/") + "/" + name
        yield RealCgroup(version, path, kernel_path, limit_bytes)
    finally:
        _remove(path)
