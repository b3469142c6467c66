"""Booting the guest under qemu and collecting what its scenario reports.

Owns the qemu command line, the share directory handed to the guest over 9p
(the scenario and its config go in, ``results.jsonl`` comes out), watching
the run (printing each step as the guest reports it, handing each event it
reports to the driver), the overall timeout and stopping qemu (only the
process this module started). The disk is attached with ``-snapshot``: the
cached image is never modified by a boot.

The guest's only network is qemu's user-mode stack with ``restrict=on`` (no
route out, not to the host either) and one forward, from a loopback port of
the host to the guest's sshd, for the Ansible step (:mod:`systest.fleet`).

qemu's monitor (QMP) listens on ``qmp.sock`` in the run's directory: when the guest
reports a ``power-cut`` event (a faults step, ``make systest-faults``), the guest is
reset at once (:func:`systest.qmp.power_cut`) and boots again in the same qemu, with
what it had written on its disk; the scenario goes on from the share.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from systest import qmp, report
from systest.accel import Accel
from systest.guest import scenario
from systest.image import Image

log = logging.getLogger(__name__)

SCENARIO = Path(__file__).parent / "guest" / "scenario.py"
MEMORY_MB = 2048
CPUS = 2
POWER_CUT_STEP = "power-cut"  # the host's line for each reset a faults step asked for


@dataclass(frozen=True)
class BootOutcome:
    qemu_rc: int | None  # None when it was killed at the timeout
    elapsed_s: float
    first_result_s: float | None  # boot until the scenario's first line
    timed_out: bool
    results: report.ParsedResults
    source: str  # "share" or "console"
    console: Path


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (qemu binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nic_args(ssh_port: int | None) -> list[str]:
    """No network, or user-mode networking isolated but for host 127.0.0.1:PORT -> guest :22."""
    if ssh_port is None:
        return ["-nic", "none"]
    return [
        "-nic",
        f"user,model=virtio-net-pci,restrict=on,hostfwd=tcp:127.0.0.1:{ssh_port}-:22",
    ]


def qemu_command(
    image: Image,
    accel: Accel,
    share: Path,
    console: Path,
    ssh_port: int | None = None,
    monitor: Path | None = None,
) -> list[str]:
    append = (
        "root=/dev/vda rw console=ttyS0 systemd.unified_cgroup_hierarchy=1 panic=-1 "
        "systemd.show_status=false quiet"
    )
    return [
        "qemu-system-x86_64",
        *accel.qemu_args,
        "-m",
        str(MEMORY_MB),
        "-smp",
        str(CPUS),
        "-nodefaults",
        "-display",
        "none",
        "-no-reboot",
        *nic_args(ssh_port),
        "-serial",
        f"file:{console}",
        "-kernel",
        str(image.kernel),
        "-initrd",
        str(image.initrd),
        "-append",
        append,
        "-drive",
        f"file={image.disk},format=raw,if=virtio,cache=unsafe",
        "-snapshot",
        "-virtfs",
        f"local,path={share},mount_tag=systest,security_model=none,id=systest",
        *(["-qmp", f"unix:{monitor},server=on,wait=off"] if monitor is not None else []),
    ]


def prepare_share(share: Path, config: dict[str, Any], files: Mapping[str, bytes | Path]) -> None:
    """The share's files: bytes as given, a Path copied (the package, 300 MB)."""
    shutil.rmtree(share, ignore_errors=True)
    share.mkdir(parents=True)
    for name, data in files.items():
        if isinstance(data, Path):
            shutil.copyfile(data, share / name)
        else:
            (share / name).write_bytes(data)
    shutil.copyfile(SCENARIO, share / "scenario.py")
    (share / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []


def power_cut_step(monitor: Path, event: Mapping[str, Any]) -> report.StepResult:
    """Reset the guest as the event asks: a host line of the report (a failure says why;
    the guest's step, waiting for the reset that does not come, fails too)."""
    t0 = time.monotonic()
    what = f"for the guest's {event.get('step')}"
    try:
        qmp.power_cut(monitor)
    except qmp.QmpError as err:
        return report.StepResult(POWER_CUT_STEP, report.FAIL, f"{what}: {err}",
                                 time.monotonic() - t0, where="host")  # fmt: skip
    return report.StepResult(POWER_CUT_STEP, report.PASS, f"{what}: guest reset over QMP",
                             time.monotonic() - t0, where="host")  # fmt: skip


def _reboots_end_qemu(monitor: Path) -> None:
    try:
        qmp.reboots_end_qemu(monitor)
    except qmp.QmpError as err:  # a guest reboot now restarts the guest instead of ending qemu
        log.warning("could not put -no-reboot's action back: %s", err)


def boot(
    image: Image,
    accel: Accel,
    workdir: Path,
    config: dict[str, Any],
    files: Mapping[str, bytes | Path],
    timeout_s: float,
    on_step: Callable[[report.StepResult], None],
    ssh_port: int | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> BootOutcome:
    """Boot, run the scenario, wait for poweroff (or the timeout); parse the results.

    ``on_event`` gets each event line the guest writes, once, while it runs (the
    Ansible step's hand-over); it may block, and its time counts against the timeout.
    """
    share = workdir / "share"
    console = workdir / "console.log"
    prepare_share(share, config, files)
    console.unlink(missing_ok=True)
    results_file = share / "results.jsonl"
    monitor = workdir / "qmp.sock"
    monitor.unlink(missing_ok=True)
    cmd = qemu_command(image, accel, share, console, ssh_port, monitor)
    log.info("qemu: %s", " ".join(cmd))
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    shown = 0
    events_seen = 0
    first: float | None = None
    timed_out = False
    try:
        while proc.poll() is None:
            parsed = report.parse_results(_read_lines(results_file))
            if first is None and (parsed.steps or parsed.events):
                first = time.monotonic() - start
            for step in parsed.steps[shown:]:
                on_step(step)
            shown = max(shown, len(parsed.steps))
            for event in parsed.events[events_seen:]:
                events_seen += 1
                if event.get("event") == scenario.POWER_CUT:
                    on_step(power_cut_step(monitor, event))
                elif event.get("event") == "resume":  # booted again: -no-reboot's action back
                    _reboots_end_qemu(monitor)
                if on_event is not None:
                    on_event(event)
            if time.monotonic() - start > timeout_s:
                timed_out = True
                break
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    elapsed = time.monotonic() - start
    qemu_out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    if qemu_out.strip():
        (workdir / "qemu.log").write_text(qemu_out)
    parsed = report.parse_results(_read_lines(results_file))
    source = "share"
    if not parsed.steps:
        # The share gave nothing (9p failed, or the guest died early): fall back
        # to the lines the scenario echoed on the serial console.
        fallback = report.parse_results(_read_lines(console), prefix=report.CONSOLE_PREFIX)
        if fallback.steps or fallback.events:
            parsed, source = fallback, "console"
    for step in parsed.steps[shown:]:
        on_step(step)
    return BootOutcome(
        qemu_rc=None if timed_out else proc.returncode,
        elapsed_s=elapsed,
        first_result_s=first,
        timed_out=timed_out,
        results=parsed,
        source=source,
        console=console,
    )
