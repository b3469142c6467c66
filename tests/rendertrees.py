"""Fixtures for the render/apply tests: plans built by hand and board root trees.

Boot files are shaped like the ones shipped by Armbian (Orange Pi 5, RK3588S),
a Rockchip vendor image (uEnv.txt with bootargs) and NVIDIA L4T 36 on a Jetson
Orin Nano developer kit (extlinux.conf with ${cbootargs}).
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from slmguard.plan.schema import (
    BoardSpec,
    EngineSettings,
    KernelSettings,
    Limits,
    ModelSpec,
    Plan,
)

GiB = 1 << 30
MiB = 1 << 20

ARMBIAN_ENV = """\
verbosity=1
bootlogo=false
console=both
extraargs=cma=256M
overlay_prefix=rockchip-rk3588
fdtfile=rockchip/rk3588s-orangepi-5.dtb
rootdev=UUID=6f1e4c2a-3b8d-4e0f-9a51-2c7d8e9f0a1b
rootfstype=ext4
usbstoragequirks=0x2537:0x1066:u,0x2537:0x1068:u
"""

ROCKCHIP_UENV = """\
# Rockchip vendor image boot environment (imported by U-Boot with env import -t)
fdtfile=rockchip/rk3588-evb1-lp4-v10.dtb
bootargs=earlycon=uart8250,mmio32,0xfeb50000 console=ttyFIQ0 console=tty1 consoleblank=0 \
loglevel=7 rootwait root=PARTLABEL=rootfs rootfstype=ext4 rw \
systemd.unified_cgroup_hierarchy=1
"""

JETSON_EXTLINUX = """\
TIMEOUT 30
DEFAULT primary

MENU TITLE L4T boot options

LABEL primary
      MENU LABEL primary kernel
      LINUX /boot/Image
      FDT /boot/dtb/kernel_tegra234-p3768-0000+p3767-0005-nv.dtb
      INITRD /boot/initrd
      APPEND ${cbootargs} root=PARTUUID=0b8a4a3e-8d6b-4b0c-9d8e-1f2a3b4c5d6e rw rootwait \
rootfstype=ext4 mminit_loglevel=4 console=ttyTCU0,115200 firmware_class.path=/etc/firmware \
fbcon=map:0 net.ifnames=0 nospectre_bhb video=efifb:off console=tty0

# When testing a custom kernel, it is recommended that you create a backup of
# the original kernel and add a new entry to this file so that the device can
# fallback to the original kernel. To do this:
#
# 1, Make a backup of the original kernel
#      sudo cp /boot/Image /boot/Image.backup
#
# 2, Copy your custom kernel into /boot/Image
#
# 3, Uncomment below menu setting lines for the original kernel
#
# 4, Reboot

# LABEL backup
#    MENU LABEL backup kernel
#    LINUX /boot/Image.backup
#    FDT /boot/dtb/kernel_tegra234-p3768-0000+p3767-0005-nv.dtb
#    INITRD /boot/initrd
#    APPEND ${cbootargs}
"""

FSTAB_WITH_SWAP = """\
# <file system>                            <mount point> <type> <options>          <dump> <pass>
UUID=6f1e4c2a-3b8d-4e0f-9a51-2c7d8e9f0a1b  /             ext4   defaults,noatime   0      1
tmpfs                                      /tmp          tmpfs  defaults,nosuid    0      0
/swapfile                                  none          swap   sw                 0      0
"""

JETSON_NVZRAM_UNIT = """\
[Unit]
Description=ZRAM configuration

[Service]
Type=oneshot
ExecStart=/etc/systemd/nvzramconfig.sh
RemainAfterExit=yes

[Install]
WantedBy=multi-user.target
"""

BOARDS = {
    "armbian": ("boot/armbianEnv.txt", ARMBIAN_ENV),
    "uenv": ("boot/uEnv.txt", ROCKCHIP_UENV),
    "extlinux": ("boot/extlinux/extlinux.conf", JETSON_EXTLINUX),
}


def make_plan(
    *,
    ram_bytes: int = 4 * GiB,
    memory_max_bytes: int = 2 * GiB + 512 * MiB,
    memory_high_bytes: int = 2 * GiB,
    os_reserve_bytes: int = 512 * MiB,
    business_reserve_bytes: int = 512 * MiB,
    cma_bytes: int | None = 512 * MiB,
    boot_file: str | None = None,
    overcommit_memory: int = 2,
    overcommit_ratio: int = 80,
    commit_charge_bytes: int = 1 * GiB,
    use_mlock: bool = False,
    device_nodes: tuple[str, ...] = ("/dev/dri/renderD128", "/dev/rknpu"),
    device_groups: tuple[str, ...] = ("render", "video"),
    cpu_affinity: tuple[int, ...] = (4, 5, 6, 7),
    model_path: str | None = "/var/lib/slmguard/models/gemma-3-270m-q4_k_m.gguf",
    model_bytes: int = 253_000_000,
    model_sha256: str | None = None,
) -> Plan:
    return Plan(
        model=ModelSpec(
            name="gemma-3-270m-q4_k_m",
            arch="gemma3",
            file_bytes=model_bytes,
            n_layer=18,
            n_ctx_train=32768,
            path=model_path,
            preset=None if model_path else "gemma-3-270m-it",
            sha256=model_sha256,
        ),
        board=BoardSpec(
            name="rk3588-4g",
            ram_bytes=ram_bytes,
            cpus=(0, 1, 2, 3, 4, 5, 6, 7),
            big_cores=(4, 5, 6, 7),
            device_nodes=device_nodes,
            device_groups=device_groups,
            boot_file=boot_file,
        ),
        engine=EngineSettings(
            n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=4, use_mlock=use_mlock
        ),
        limits=Limits(
            memory_high_bytes=memory_high_bytes,
            memory_max_bytes=memory_max_bytes,
            os_reserve_bytes=os_reserve_bytes,
            business_reserve_bytes=business_reserve_bytes,
        ),
        kernel=KernelSettings(
            swappiness=0,
            overcommit_memory=overcommit_memory,
            overcommit_ratio=overcommit_ratio,
            commit_charge_bytes=commit_charge_bytes,
            cma_bytes=cma_bytes,
        ),
        cpu_affinity=cpu_affinity,
    )


def write(root: Path, rel: str, text: str | bytes, mode: int = 0o644) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, str):
        text = text.encode()
    path.write_bytes(text)
    path.chmod(mode)
    return path


def make_board_root(root: Path, board: str, boot_text: str | None = None) -> Path:
    """A small root tree of a board: boot file, fstab with swap, an existing zram unit."""
    rel, text = BOARDS[board]
    write(root, rel, boot_text if boot_text is not None else text, 0o755)
    write(root, "etc/fstab", FSTAB_WITH_SWAP)
    write(root, "etc/hostname", "board\n")
    units = root / "etc/systemd/system"
    wants = units / "multi-user.target.wants"
    wants.mkdir(parents=True)
    if board == "extlinux":  # L4T ships its zram unit in /etc/systemd/system
        write(root, "etc/systemd/system/nvzramconfig.service", JETSON_NVZRAM_UNIT)
        (wants / "nvzramconfig.service").symlink_to("../nvzramconfig.service")
    else:
        write(root, "lib/systemd/system/armbian-zram-config.service", JETSON_NVZRAM_UNIT)
        (wants / "armbian-zram-config.service").symlink_to(
            "/lib/systemd/system/armbian-zram-config.service"
        )
    write(root, "proc/meminfo", "MemTotal:        3995420 kB\nHugetlb:               0 kB\n")
    return root


#: Files above this are held by sha256, not bytes (a fleet's many model copies would not
#: fit in memory).
SNAPSHOT_BYTES_MAX = 1 << 20
_digests: dict[tuple[int, int, int, int], str] = {}


def _large_digest(path: Path, st: os.stat_result) -> str:
    """A large file's sha256, hashed once per file version (device, inode, size, mtime)."""
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _digests:
        h = hashlib.sha256()
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        _digests[key] = h.hexdigest()
    return _digests[key]


def snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    """Every path under root: files by bytes (large ones by sha256), mode, mtime and size,
    links by target, dirs by mode."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                data = p.read_bytes() if st.st_size <= SNAPSHOT_BYTES_MAX else _large_digest(p, st)
                out[rel] = ("file", data, stat.S_IMODE(st.st_mode), st.st_mtime_ns, st.st_size)
    return out


def make_model_file(path: Path, size: int = 64 << 10) -> tuple[Path, int, str]:
    """A stand-in model file (GGUF magic and bytes): (path, size, sha256).

    A plan made from a file is checked by size and sha256 only, so the
    render/apply tests need no real weights; tests of preset plans use a
    written GGUF or the real model.
    """
    data = b"GGUF" + bytes(range(256)) * (size // 256)
    data = data[:size]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(0o644)
    return path, size, hashlib.sha256(data).hexdigest()


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``slmguard ARGV`` in this process: (exit status, stdout and stderr)."""
    from slmguard.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out + err
