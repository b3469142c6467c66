"""Host packages the systest needs, installed from Debian's archive.

Owns finding (or installing, with apt-get, as root) qemu, mmdebstrap,
e2fsprogs and the OpenSSH client. CI machines are fresh, so the driver
installs them itself; a developer machine that already has them is not
touched.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Mapping

log = logging.getLogger(__name__)

# tool -> Debian package that provides it
TOOLS: Mapping[str, str] = {
    "qemu-system-x86_64": "qemu-system-x86",
    "mmdebstrap": "mmdebstrap",
    "mkfs.ext4": "e2fsprogs",
    "ssh": "openssh-client",  # the Ansible step's connection, and its key
    "ssh-keygen": "openssh-client",
}


class HostUnfit(Exception):
    """The host cannot build or boot the guest; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def ensure_host_tools() -> list[str]:
    """Install the Debian packages for missing tools; return the packages installed.

    Raises :class:`HostUnfit` when not root, when apt-get is missing or fails,
    or when a tool is still missing afterwards.
    """
    missing = missing_tools()
    if not missing:
        return []
    packages = sorted({TOOLS[t] for t in missing})
    if os.geteuid() != 0:
        raise HostUnfit(f"missing {', '.join(missing)} and not root to apt-get install them")
    if shutil.which("apt-get") is None:
        raise HostUnfit(f"missing {', '.join(missing)} and no apt-get to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
    ):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise HostUnfit(f"{' '.join(cmd[:2])} failed ({done.returncode}): {' / '.join(tail)}")
    still = missing_tools()
    if still:
        raise HostUnfit(f"still missing after apt-get install: {', '.join(still)}")
    return packages
