"""Kernel and swap settings from the plan: sysctl, fstab swap lines, zram.

Pure text. ``sysctl_conf`` renders ``/etc/sysctl.d/99-slmguard.conf``;
``disable_fstab_swap`` comments out the swap lines of an existing fstab (only
those; every other byte is kept); zram is disabled by masking the services
that set it up on the boards we target and by an ``/etc/systemd/zram-generator.conf``
without devices (it replaces the distribution's ``/usr/lib`` file of the same
name, zram-generator(8)).
"""

from __future__ import annotations

from slmguard.plan.schema import Plan

#: Services that turn on zram or a swap file on Armbian, Debian/Ubuntu
#: (zram-tools, zram-config), Jetson L4T, Raspberry Pi OS and zram-generator.
SWAP_SERVICES = (
    "armbian-zram-config.service",
    "zramswap.service",
    "zram-config.service",
    "nvzramconfig.service",
    "dphys-swapfile.service",
    "systemd-zram-setup@zram0.service",
)

ZRAM_GENERATOR_CONF = (
    "# Written by slmguard: no [zramN] section, so zram-generator creates no zram swap.\n"
)

FSTAB_MARK = "#slmguard-disabled# "


def sysctl_conf(plan: Plan) -> str:
    k = plan.kernel
    lines = [
        f"# Written by slmguard from the plan for {plan.model.name} on {plan.board.name}.",
        "# Applied at boot by systemd-sysctl; `slmguard rollback` removes it.",
        "# No swapping: flash wears out and swap latency stalls token output.",
        f"vm.swappiness = {k.swappiness}",
        f"vm.overcommit_memory = {k.overcommit_memory}",
    ]
    if k.overcommit_memory == 2:
        lines += [
            "# CommitLimit = (RAM - huge pages) * overcommit_ratio / 100 + swap",
            f"vm.overcommit_ratio = {k.overcommit_ratio}",
        ]
    return "\n".join(lines) + "\n"


def _is_swap_line(line: str) -> bool:
    fields = line.split()
    return len(fields) >= 3 and not fields[0].startswith("#") and fields[2] == "swap"


def fstab_swap_lines(text: str) -> list[str]:
    """The active swap entries of an fstab."""
    return [line for line in text.splitlines() if _is_swap_line(line)]


def disable_fstab_swap(text: str) -> str:
    """``text`` with every active swap entry commented out (marked, so it is visible)."""
    out = []
    for line in text.splitlines(keepends=True):
        out.append(FSTAB_MARK + line if _is_swap_line(line) else line)
    return "".join(out)
