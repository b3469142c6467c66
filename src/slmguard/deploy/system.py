"""Kernel and swap settings from the plan: sysctl, fstab swap lines, zram.

Pure text. ``sysctl_conf`` renders ``/etc/sysctl.d/99-slmguard.conf``;
``disable_fstab_swap`` comments out the swap lines of an existing fstab (only
those; every other byte is kept); zram is disabled by masking the services
that set it up on the boards we target and by an ``/etc/systemd/zram-generator.conf``
without devices (it replaces the distribution's ``/usr/lib`` file of the same
name, zram-generator(8)).
"""

from __future__ import annotations

from slmguard.deploy import escape
from slmguard.host.fstab import is_swap_entry
from slmguard.plan.schema import Plan

SYSCTL_PATH = "/etc/sysctl.d/99-slmguard.conf"
ZRAM_GENERATOR_PATH = "/etc/systemd/zram-generator.conf"
FSTAB_PATH = "/etc/fstab"

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

#: What the kernel accepts for each key we set: swappiness 0..200 (Linux 5.8; 0..100
#: before), overcommit_memory 0..2, overcommit_ratio any non-negative int
#: (proc_dointvec; a negative ratio is meaningless).
SYSCTL_RANGES = {
    "vm.swappiness": (0, 200),
    "vm.overcommit_memory": (0, 2),
    "vm.overcommit_ratio": (0, (1 << 31) - 1),
}
_SYSCTL_FIELDS = {
    "vm.swappiness": "plan.kernel.swappiness",
    "vm.overcommit_memory": "plan.kernel.overcommit_memory",
    "vm.overcommit_ratio": "plan.kernel.overcommit_ratio",
}


def sysctl_settings(plan: Plan) -> tuple[tuple[str, int], ...]:
    """The sysctl keys the deployment sets, with the plan's values."""
    k = plan.kernel
    settings = [("vm.swappiness", k.swappiness), ("vm.overcommit_memory", k.overcommit_memory)]
    if k.overcommit_memory == 2:
        settings.append(("vm.overcommit_ratio", k.overcommit_ratio))
    return tuple(settings)


def sysctl_conf(plan: Plan) -> str:
    """The sysctl.d file: integers inside the kernel's ranges, names only as labels."""
    model, board = escape.label(plan.model.name), escape.label(plan.board.name)
    lines = [
        f"# Written by slmguard from the plan for {model} on {board}.",
        "# Applied at boot by systemd-sysctl; `slmguard rollback` removes it.",
        "# No swapping: flash wears out and swap latency stalls token output.",
    ]
    for key, value in sysctl_settings(plan):
        if key == "vm.overcommit_ratio":
            lines.append("# CommitLimit = (RAM - huge pages) * overcommit_ratio / 100 + swap")
        lo, hi = SYSCTL_RANGES[key]
        lines.append(escape.sysctl_line(key, value, lo, hi, _SYSCTL_FIELDS[key]))
    return "\n".join(lines) + "\n"


def sysctl_keys(conf_text: str) -> list[str]:
    """The keys a sysctl.d file sets (``key = value`` lines; comments skipped)."""
    keys = []
    for line in conf_text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, _ = line.lstrip("-").partition("=")
        if sep and key.strip():
            keys.append(key.strip())
    return keys


def fstab_swap_lines(text: str) -> list[str]:
    """The active swap entries of an fstab."""
    return [line for line in text.splitlines() if is_swap_entry(line)]


def disable_fstab_swap(text: str) -> str:
    """``text`` with every active swap entry commented out (marked, so it is visible)."""
    out = []
    for line in text.splitlines(keepends=True):
        out.append(FSTAB_MARK + line if is_swap_entry(line) else line)
    return "".join(out)
