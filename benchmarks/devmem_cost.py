"""What reading the engine's device memory costs the governor, per sample.

With a plan that gives the engine's offloaded buffers an allowance outside the
cgroup (``limits.device_bytes``: Jetson's nvmap, Mali kbase), every governor
sample also reads :func:`slmguard.host.devmem.read_device_memory`: the engine's
fd directory (its DMA-BUF fds and their fdinfo, its DRM fds and their fdinfo),
``/proc/meminfo`` for ``NvMapMemUsed`` and debugfs's nvmap clients. This script
times that read, and the whole sample (:meth:`slmguard.governor.signal.MemorySignal.sample`)
with the allowance and without it, in microseconds per call:

- over the captured board trees of ``tests/`` (the Orin Nano's meminfo with its
  NvMap lines and debugfs nvmap clients, the RK3588 and Pi 5 trees) with an engine
  process from ``tests/gputrees.py`` (DRM fds with fdinfo, a DMA-BUF fd); a fixture
  tree lives on this machine's file system, so these are the parsing and the file
  system calls, not the kernel's own generation of the files;
- on the real llama-server (make's CPU build, or ``--llama-server``) with the embedded
  model, loaded and idle, when both are there;
- on a live child process of this machine holding 16, 256, 1024 and 4096 open fds
  (``/dev/null``: each is listed and its link read; none is a DRM or DMA-BUF fd
  here, there is no GPU), against this machine's own ``/proc`` and memory cgroup;
- the system-wide DMA-BUF total (``/sys/kernel/debug/dma_buf/bufinfo``, which the
  doctor and the watcher read, not the governor) on the captured Orin Nano.

Each figure is the median over ``--batches`` batches of ``--calls`` calls (wall
clock, ``time.perf_counter``), with the slowest batch beside it. The governor's
sampling interval is adaptive, 20 ms at the closest (near a watermark) to 1 s
(far from one): the cost is given as a share of the 20 ms floor.

Usage (prints only, unless --write-results):
    .venv/bin/python benchmarks/devmem_cost.py
    .venv/bin/python benchmarks/devmem_cost.py --write-results
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launch import bare_engine, embedded_model, stop
from results_md import write_section

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

from gputrees import PANTHOR_FDINFO, V3D_FDINFO, engine_process  # noqa: E402
from hostboards import copy_board  # noqa: E402
from hosttree import build_tree  # noqa: E402
from slmguard.governor.signal import DEFAULT_MIN_INTERVAL_S, MemorySignal  # noqa: E402
from slmguard.host import cgroup as cg  # noqa: E402
from slmguard.host.devmem import read_device_memory  # noqa: E402
from slmguard.host.dmabuf import read_dmabuf_totals  # noqa: E402

SECTION = "## governor device-memory reading"
ENGINE_PID = 4242
CG = "sys/fs/cgroup/slmguard.service"
MIB = 1 << 20
LIVE_FDS = (16, 256, 1024, 4096)


def per_call_us(fn: Callable[[], object], calls: int, batches: int) -> tuple[float, float]:
    """(median, slowest) microseconds per call over ``batches`` batches of ``calls``."""
    for _ in range(max(5, calls // 10)):
        fn()  # warm: imports, dentry cache
    per_batch = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_batch.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(per_batch), max(per_batch)


def board_root(tmp: Path, board: str, drm_fdinfo: str, *, dmabuf_bytes: int) -> Path:
    """A captured board with a cgroup v2 service and the engine's fds under it."""
    root = copy_board(board, tmp / board)
    build_tree(root, {
        f"{CG}/memory.current": f"{800 * MIB}\n",
        f"{CG}/memory.high": "max\n",
        f"{CG}/memory.max": f"{1000 * MIB}\n",
        f"{CG}/memory.stat": "anon 0\ninactive_file 0\n",
        f"{CG}/memory.events": "oom_kill 0\n",
        **engine_process(ENGINE_PID, drm_fdinfo, dup_fds=4, dmabuf_bytes=dmabuf_bytes),
    })  # fmt: skip
    return root


def tree_rows(tmp: Path, calls: int, batches: int) -> list[dict[str, Any]]:
    cases = [
        ("jetson-orin-nano-devkit", "pos:\t0\n", 0, "NvMap lines, debugfs nvmap clients"),
        ("rk3588-rock5b", PANTHOR_FDINFO, 8 * MIB, "4 panthor DRM fds, 1 DMA-BUF fd"),
        ("rpi5", V3D_FDINFO, 0, "4 v3d DRM fds"),
    ]
    rows = []
    for board, fdinfo, dmabuf, what in cases:
        root = board_root(tmp, board, fdinfo, dmabuf_bytes=dmabuf)
        mem = read_device_memory(root, ENGINE_PID)
        assert mem is not None, board
        with_dev = MemorySignal(root, cgroup_dir=root / CG, device_bytes=800 * MIB,
                                device_pid=lambda: ENGINE_PID)  # fmt: skip
        without = MemorySignal(root, cgroup_dir=root / CG)
        snap = with_dev.sample()
        rows.append({
            "case": f"{board} tree ({what})",
            "device": per_call_us(lambda r=root: read_device_memory(r, ENGINE_PID), calls, batches),
            "sample_with": per_call_us(with_dev.sample, calls, batches),
            "sample_without": per_call_us(without.sample, calls, batches),
            "counted": f"{snap.device_bytes / MIB:.1f} MiB ({snap.device_source})",
            "problems": mem.problems,
        })  # fmt: skip
    return rows


HOLDER = (
    "import os, sys\n"
    "fds = [os.open('/dev/null', os.O_RDONLY) for _ in range(int(sys.argv[1]))]\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)


def live_rows(calls: int, batches: int) -> list[dict[str, Any]]:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(LIVE_FDS) + 64
    if soft < want <= hard or hard == resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    cgroup_dir = cg.memory_cgroup_dir(Path("/"))
    rows = []
    for n in LIVE_FDS:
        child = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(n)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            pid = child.pid
            open_fds = len(os.listdir(f"/proc/{pid}/fd"))
            with_dev = MemorySignal(cgroup_dir=cgroup_dir, device_bytes=800 * MIB,
                                    device_pid=lambda p=pid: p)  # fmt: skip
            without = MemorySignal(cgroup_dir=cgroup_dir)
            snap = with_dev.sample()
            # Fewer calls for the big ones: each is a few ms.
            k = max(10, calls * 16 // max(16, n))
            rows.append({
                "case": f"live process, {open_fds} open fds (this machine's /proc)",
                "device": per_call_us(lambda p=pid: read_device_memory(Path("/"), p), k, batches),
                "sample_with": per_call_us(with_dev.sample, k, batches),
                "sample_without": per_call_us(without.sample, k, batches),
                "counted": f"{snap.device_bytes / MIB:.1f} MiB ({snap.device_source})",
                "problems": (),
            })  # fmt: skip
        finally:
            assert child.stdin is not None
            child.stdin.close()
            child.wait(30)
    return rows


def engine_row(calls: int, batches: int, binary: str | None) -> dict[str, Any] | None:
    """The real llama-server (make's CPU build, or ``binary``), loaded and idle, with the
    embedded model, as the process the governor reads: None without a build or model."""
    from slmguard.errors import EngineUnavailableError
    from slmguard.serve.llamaserver import find_llama_server

    try:
        engine = find_llama_server(binary)
    except EngineUnavailableError:
        return None
    if not embedded_model().exists():
        return None
    proc, _ = bare_engine(engine, "--ctx-size", "512", "--threads", "2")
    try:
        pid = proc.pid
        open_fds = len(os.listdir(f"/proc/{pid}/fd"))
        cgroup_dir = cg.memory_cgroup_dir(Path("/"))
        with_dev = MemorySignal(cgroup_dir=cgroup_dir, device_bytes=800 * MIB,
                                device_pid=lambda: pid)  # fmt: skip
        without = MemorySignal(cgroup_dir=cgroup_dir)
        snap = with_dev.sample()
        return {
            "case": f"the real llama-server (CPU build), loaded and idle: {open_fds} open fds",
            "device": per_call_us(lambda: read_device_memory(Path("/"), pid), calls, batches),
            "sample_with": per_call_us(with_dev.sample, calls, batches),
            "sample_without": per_call_us(without.sample, calls, batches),
            "counted": f"{snap.device_bytes / MIB:.1f} MiB ({snap.device_source})",
            "problems": (),
        }
    finally:
        stop(proc)


def machine_state() -> str:
    load = os.getloadavg()
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min) at the end"
    )


def fmt(pair: tuple[float, float]) -> str:
    return f"{pair[0]:.0f} ({pair[1]:.0f})"


def render(rows: list[dict[str, Any]], bufinfo: tuple[float, float], args: Any) -> str:
    floor_us = DEFAULT_MIN_INTERVAL_S * 1e6
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        SECTION,
        "",
        f"`benchmarks/devmem_cost.py`, {now:%Y-%m-%d %H:%M} UTC, {machine_state()}; "
        f"{args.batches} batches per figure. Microseconds per "
        "call: median batch (slowest batch). `device read` is `read_device_memory` alone, "
        "what a sample adds when the plan gives the device an allowance; `sample` is the "
        "governor's whole `MemorySignal.sample()` with the allowance and without it; `share "
        f"of 20 ms` is the device read against the governor's closest sampling interval "
        f"({DEFAULT_MIN_INTERVAL_S * 1000:.0f} ms; 1 s far from every watermark).",
        "",
        "| case | device read us | sample with device us | sample without us | "
        "share of 20 ms | counted |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        share = 100 * r["device"][0] / floor_us
        lines.append(
            f"| {r['case']} | {fmt(r['device'])} | {fmt(r['sample_with'])} | "
            f"{fmt(r['sample_without'])} | {share:.2f}% | {r['counted']} |"
        )
    lines += [
        "",
        f"The system-wide DMA-BUF total from the captured Orin Nano's debugfs `bufinfo` "
        f"(`read_dmabuf_totals`, doctor and watch): {fmt(bufinfo)} us per read.",
    ]
    problems = sorted({p for r in rows for p in r["problems"]})
    if problems:
        lines += ["", "Problems the reads reported (as the governor logs them once): "
                  + "; ".join(f"`{p}`" for p in problems)]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=400, help="calls per batch (fewer per fd)")
    ap.add_argument("--batches", type=int, default=15)
    ap.add_argument("--llama-server", default=None, help="the engine (default: make's)")
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="slmguard-devmem-") as tmp:
        rows = tree_rows(Path(tmp), args.calls, args.batches)
        orin = Path(tmp) / "jetson-orin-nano-devkit"
        bufinfo = per_call_us(lambda: read_dmabuf_totals(orin), args.calls, args.batches)
    engine = engine_row(args.calls, args.batches, args.llama_server)
    rows += [engine] if engine is not None else []
    rows += live_rows(args.calls, args.batches)
    text = render(rows, bufinfo, args)
    print(text)
    if args.write_results:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
