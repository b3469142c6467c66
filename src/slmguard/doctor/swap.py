"""Doctor checks on swap and zram: none active now, none coming back at boot.

Owns ``swap.off``, ``swap.boot``, ``zram.off`` and ``zram.boot``: active swap
areas (/proc/swaps), fstab swap lines and swap-file services, zram devices and
the services that recreate them. Pure: reads only the snapshot.
"""

from __future__ import annotations

from slmguard.doctor.findings import CheckId, Evidence, Finding, mib
from slmguard.host.snapshot import HostSnapshot, Unread
from slmguard.plan.schema import Plan


def check_swap_off(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("swap.off", "No active swap")
    if isinstance(s.swaps, Unread):
        return check.unread(s.swaps)
    src = str(s.root / "proc/swaps")
    if not s.swaps:
        return check.passed("no swap area is active", (Evidence("swaps", "none", src),))
    ev = tuple(
        Evidence(a.filename, f"{a.kind}, {mib(a.size_bytes)}, {mib(a.used_bytes)} used", src)
        for a in s.swaps
    )
    return check.fail(
        f"{len(s.swaps)} swap area(s) active: under memory pressure the board thrashes "
        "instead of OOM-killing, and flash wears out",
        ev,
        "swapoff -a",
    )


def check_swap_boot(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("swap.boot", "No swap comes back at boot")
    if isinstance(s.fstab_swaps, Unread):
        return check.unread(s.fstab_swaps)
    src = str(s.root / "etc/fstab")
    at_boot = [e for e in s.fstab_swaps if e.at_boot]
    ev = [Evidence(f"fstab line {e.lineno}", e.line.strip(), src) for e in s.fstab_swaps]
    services = s.swapfile_services if isinstance(s.swapfile_services, tuple) else ()
    ev.extend(Evidence(x.name, x.reason, str(x.path)) for x in services)
    enabled = [x for x in services if x.enabled]
    if not at_boot and not enabled:
        return check.passed("no fstab swap line or swap-file service at boot", ev)
    fixes = [f"sed -i '{e.lineno}s/^/# /' /etc/fstab" for e in at_boot]
    fixes += [x.fix for x in enabled]
    what = []
    if at_boot:
        what.append("fstab turns swap back on at every boot (swapon -a, systemd)")
    if enabled:
        what.append(", ".join(x.name for x in enabled) + " creates a swap file at boot")
    return check.fail("; ".join(what), ev, " && ".join(fixes))


def check_zram_off(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("zram.off", "No zram device in use")
    if isinstance(s.zram_devices, Unread):
        return check.unread(s.zram_devices)
    active = [d for d in s.zram_devices if d.active]
    ev = tuple(
        Evidence(
            d.name,
            f"disksize {mib(d.disksize_bytes)}"
            + (f", uses {mib(d.mem_used_bytes)} RAM" if d.mem_used_bytes is not None else ""),
            str(s.root / "sys/block" / d.name / "disksize"),
        )
        for d in s.zram_devices
    )
    if not active:
        what = "no zram device" if not s.zram_devices else "zram devices exist but are not set up"
        return check.passed(what, ev)
    fix = " && ".join(f"swapoff /dev/{d.name}; echo 1 > /sys/block/{d.name}/reset" for d in active)
    return check.fail(
        "zram is set up: compressing pages under pressure burns the CPU the model needs "
        "and hides the OOM that should restart the service",
        ev,
        fix,
    )


def check_zram_boot(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("zram.boot", "No service recreates zram at boot")
    if isinstance(s.zram_services, Unread):
        return check.unread(s.zram_services)
    ev = tuple(Evidence(x.name, x.reason, str(x.path)) for x in s.zram_services)
    enabled = [x for x in s.zram_services if x.enabled]
    if not enabled:
        what = (
            "zram services are installed but disabled"
            if s.zram_services
            else "no zram service installed"
        )
        return check.passed(what, ev)
    return check.fail(
        "zram comes back at the next boot via " + ", ".join(x.name for x in enabled),
        ev,
        " ; ".join(x.fix for x in enabled),
    )
