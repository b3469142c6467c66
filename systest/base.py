"""The guest's Debian base: bootstrap, unattended-boot configuration, initramfs.

Owns the slow layer of the guest image, cached as ``base-<key>/rootfs`` under
the systest cache: Debian ``SUITE`` bootstrapped with mmdebstrap (minbase plus
``PACKAGES``), units that add boot time or console noise masked, a small
initramfs (virtio, ext4, 9p), the boot-time runner unit
(``guest/systest-runner.*``) baked in, and sshd installed but not started at
boot (the scenario's Ansible step starts it, with the key the host made for
the run, on a network it brings up itself). Its key covers this file, the baked
files, the suite and the package list (``cachekey.base_key``), nothing of the
project: editing slmguard never re-bootstraps Debian.

Built in a ``.tmp`` sibling and renamed into place. This module and ``image``
are the only ones that run commands inside the guest's root (``chroot``); they
unmount what they mounted.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from systest import cachekey

log = logging.getLogger(__name__)

SUITE = "bookworm"
KERNEL_PACKAGE = "linux-image-amd64"  # not the cloud kernel: it lacks 9p
PACKAGES: tuple[str, ...] = (
    "systemd",
    "systemd-sysv",
    "udev",
    "dbus",  # dbus: systemd-run --wait, set-property
    "python3",
    "python3-venv",
    "libgomp1",
    "libstdc++6",
    "libssl3",  # the engine's shared libraries need these
    "iproute2",
    "procps",
    "kmod",
    "zstd",
    "initramfs-tools",
    "openssh-server",  # the Ansible step: ansible-playbook on the host drives the guest
    KERNEL_PACKAGE,
)
GUEST_DIR = Path(__file__).parent / "guest"
BAKED = ("systest-runner.sh", "systest-runner.service")

# Units that add boot time or console noise and that no test step needs.
MASKED = (
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "dpkg-db-backup.timer",
    "e2scrub_all.timer",
    "fstrim.timer",
    "e2scrub_reap.service",
    "systemd-firstboot.service",
    "getty@tty1.service",
    "serial-getty@ttyS0.service",
    "systemd-pstore.service",
)
INITRAMFS_MODULES = (
    "virtio_pci",
    "virtio_blk",
    "virtio_console",
    "ext4",
    "crc32c_generic",
    "crc32c_intel",
    "9p",
    "9pnet_virtio",
)
#: sshd for the Ansible step: keys only, root by key, no DNS lookups (there is no DNS).
SSHD_CONFIG = (
    "PasswordAuthentication no\n"
    "KbdInteractiveAuthentication no\n"
    "PermitRootLogin prohibit-password\n"
    "UseDNS no\n"
)


class ImageError(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def recipe_files() -> dict[str, bytes]:
    """The files whose content defines the base layer (part of its cache key)."""
    files = {"base.py": Path(__file__).read_bytes()}
    for name in BAKED:
        files[f"guest/{name}"] = (GUEST_DIR / name).read_bytes()
    return files


def base_inputs() -> cachekey.BaseInputs:
    return cachekey.BaseInputs(SUITE, PACKAGES, recipe_files())


def parse_apt_mirror(texts: Sequence[str]) -> str | None:
    """The first Debian archive URI in apt source files (deb822 or one-line format).

    Security and ports archives are skipped: only ``.../debian`` serves ``SUITE``.
    """
    for text in texts:
        for line in text.splitlines():
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if words[0] == "URIs:":
                uris = words[1:]
            elif words[0] == "deb":
                uris = [w for w in words[1:] if "://" in w][:1]
            else:
                continue
            for uri in uris:
                if uri.rstrip("/").endswith("/debian"):
                    return uri
    return None


def host_mirror(root: Path = Path("/")) -> str:
    apt = root / "etc" / "apt"
    paths = [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*"))]
    texts = []
    for p in paths:
        try:
            texts.append(p.read_text(errors="replace"))
        except OSError:
            continue
    return parse_apt_mirror(texts) or "http://deb.debian.org/debian"


def run_logged(cmd: Sequence[str], logfile: Path, what: str) -> None:
    with logfile.open("ab") as out:
        done = subprocess.run(list(cmd), stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = logfile.read_text(errors="replace").strip().splitlines()[-5:]
        raise ImageError(f"{what} failed ({done.returncode}); see {logfile}: {' / '.join(tail)}")


@contextmanager
def chroot_mounts(rootfs: Path) -> Iterator[None]:
    mounts = [
        (["mount", "-t", "proc", "proc", str(rootfs / "proc")], rootfs / "proc"),
        (["mount", "-t", "sysfs", "sys", str(rootfs / "sys")], rootfs / "sys"),
        (["mount", "--bind", "/dev", str(rootfs / "dev")], rootfs / "dev"),
    ]
    done: list[Path] = []
    try:
        for cmd, target in mounts:
            subprocess.run(cmd, check=True, capture_output=True)
            done.append(target)
        yield
    finally:
        for target in reversed(done):
            subprocess.run(["umount", "-l", str(target)], check=False, capture_output=True)


def _configure(rootfs: Path, logfile: Path) -> None:
    etc = rootfs / "etc"
    (etc / "hostname").write_text("systest\n")
    (etc / "hosts").write_text("127.0.0.1 localhost\n127.0.1.1 systest\n")
    (etc / "fstab").write_text("/dev/vda / ext4 rw,relatime,errors=remount-ro 0 1\n")
    units = etc / "systemd" / "system"
    for unit in MASKED:
        link = units / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")
    if not (etc / "machine-id").read_text().strip():
        # an empty machine-id triggers first-boot logic; throw-away VMs can share one
        run_logged(["chroot", str(rootfs), "systemd-machine-id-setup"], logfile, "machine-id")
    (etc / "initramfs-tools" / "conf.d" / "systest.conf").write_text(
        "MODULES=list\nCOMPRESS=zstd\n"  # 6 MB instead of 36 MB with MODULES=most
    )
    (etc / "initramfs-tools" / "modules").write_text("\n".join(INITRAMFS_MODULES) + "\n")
    runner = rootfs / "usr" / "local" / "sbin" / "systest-runner"
    shutil.copyfile(GUEST_DIR / "systest-runner.sh", runner)
    runner.chmod(0o755)
    shutil.copyfile(GUEST_DIR / "systest-runner.service", units / "systest-runner.service")
    wants = units / "multi-user.target.wants"
    wants.mkdir(exist_ok=True)
    (wants / "systest-runner.service").symlink_to("/etc/systemd/system/systest-runner.service")
    # sshd: host keys made now (one set per base, fine for a throw-away VM), not
    # started at boot: only the Ansible step needs it, and it starts it.
    (wants / "ssh.service").unlink(missing_ok=True)
    (etc / "ssh" / "sshd_config.d" / "systest.conf").write_text(SSHD_CONFIG)
    with chroot_mounts(rootfs):
        run_logged(["chroot", str(rootfs), "ssh-keygen", "-A"], logfile, "ssh host keys")
        run_logged(
            ["chroot", str(rootfs), "update-initramfs", "-u", "-k", "all"], logfile, "initramfs"
        )
    for deb in (rootfs / "var" / "cache" / "apt" / "archives").glob("*.deb"):
        deb.unlink()


def build_base(cache: Path, key: str, mirror: str, logdir: Path) -> Path:
    """The configured Debian root for ``key``, bootstrapping it when not cached."""
    final = cache / f"base-{key}"
    if (final / "rootfs" / "usr" / "bin" / "python3").exists():
        os.utime(final)
        return final
    tmp = cache / f"base-{key}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rootfs = tmp / "rootfs"
    logfile = logdir / "bootstrap.log"
    run_logged(
        [
            "mmdebstrap",
            "--variant=minbase",
            "--include=" + ",".join(PACKAGES),
            "--dpkgopt=force-unsafe-io",
            "--dpkgopt=path-exclude=/usr/share/doc/*",
            "--dpkgopt=path-exclude=/usr/share/man/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*",
            SUITE,
            str(rootfs),
            mirror,
        ],
        logfile,
        "mmdebstrap",
    )
    _configure(rootfs, logdir / "configure.log")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final
