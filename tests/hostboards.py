"""Board fixture trees: a hardened and a stock RK3588 (Armbian), a Jetson Orin Nano.

File contents follow the kernel's formats (proc(5), zram.rst, cgroup-v2.rst,
dma-buf bufinfo) and the distributions' file layouts (Armbian's
armbian-zram-config, L4T's nvzramconfig). ``plan_for_rk3588()`` is the plan the
hardened tree was built to satisfy. ``SEED_UNIT`` is the source document's
unit file, kept once for the doctor and render tests.
"""

from __future__ import annotations

import re
from pathlib import Path

from hosttree import Link
from slmguard.deploy.storage import journald_conf
from slmguard.plan.planfile import dumps_plan
from slmguard.plan.schema import BoardSpec, EngineSettings, KernelSettings, Limits, ModelSpec, Plan

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

# The unit from the source document (SEED_EN.md section 3), as it gives it.
SEED_UNIT = Path(__file__).parent / "fixtures" / "units" / "slm_inference.service"


def seed_unit_text(program: str = "/bin/true") -> str:
    """The source document's unit with ExecStart= running ``program`` instead.

    ``systemd-analyze verify`` also fails on the document's program, which does
    not exist here; the tests want only the unit's own problems.
    """
    return re.sub(r"^ExecStart=\S+", f"ExecStart={program}", SEED_UNIT.read_text(), flags=re.M)


LIMITS_HEADER = "Limit                     Soft Limit           Hard Limit           Units     \n"


def meminfo(
    total_kb: int,
    available_kb: int,
    commit_limit_kb: int,
    committed_kb: int,
    cma_kb: int | None = None,
    swap_kb: int = 0,
) -> str:
    lines = [
        f"MemTotal:       {total_kb} kB",
        f"MemFree:        {available_kb - 400000} kB",
        f"MemAvailable:   {available_kb} kB",
        "Buffers:           20480 kB",
        "Cached:           512000 kB",
        f"SwapTotal:      {swap_kb} kB",
        f"SwapFree:       {swap_kb} kB",
        f"CommitLimit:    {commit_limit_kb} kB",
        f"Committed_AS:   {committed_kb} kB",
    ]
    if cma_kb is not None:
        lines += [f"CmaTotal:       {cma_kb} kB", f"CmaFree:        {cma_kb - 4096} kB"]
    return "\n".join(lines) + "\n"


def limits(memlock: str = "8388608") -> str:
    return (
        LIMITS_HEADER
        + "Max stack size            8388608              unlimited            bytes     \n"
        + f"Max locked memory         {memlock:<21}{memlock:<21}bytes     \n"
        + "Max open files            1024                 524288               files     \n"
    )


V2_MOUNTINFO = (
    "21 1 179:2 / / rw,noatime shared:1 - ext4 /dev/mmcblk1p2 rw,commit=600\n"
    "25 21 0:22 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 "
    "rw,nsdelegate,memory_recursiveprot\n"
)
PSI = (
    "some avg10=0.00 avg60=0.02 avg300=0.01 total=123456\n"
    "full avg10=0.00 avg60=0.00 avg300=0.00 total=45678\n"
)
BUFINFO = (
    "\nDma-buf Objects:\n"
    "size    \tflags   \tmode    \tcount   \texp_name\tino     \tname\n"
    "08388608\t00000002\t00080005\t00000001\trknpu\t00000123\t\n"
    "\tAttached Devices:\n"
    "\tfdab0000.npu\n"
    "Total 1 devices attached\n\n"
    "04194304\t00000002\t00080005\t00000001\tsystem\t00000124\t\n"
    "\tAttached Devices:\n"
    "Total 0 devices attached\n\n"
    "\nTotal 2 objects, 12582912 bytes\n"
)

HARDENED_UNIT = """\
[Unit]
Description=slmguard: qwen2.5-0.5b behind an OpenAI-compatible API with a memory governor
After=network-online.target
Wants=network-online.target
StartLimitIntervalSec=60
StartLimitBurst=3

[Service]
Type=notify
ExecStart=/usr/local/bin/slmguard serve --plan /etc/slmguard/plan.json
Restart=on-failure
RestartSec=5
MemoryAccounting=yes
MemoryHigh=5000M
MemoryMax=5600M
MemorySwapMax=0
OOMScoreAdjust=100
CPUAffinity=4-7
User=slmguard
Group=slmguard

[Install]
WantedBy=multi-user.target
"""

ARMBIAN_ENV_HARDENED = """\
verbosity=1
bootlogo=false
overlay_prefix=rockchip-rk3588
fdtfile=rockchip/rk3588s-orangepi-5.dtb
rootdev=UUID=8d2c3d0e-5e4c-4b6f-9a59-0c1d2e3f4a5b
rootfstype=ext4
extraargs=cma=2048M
"""

RK3588_COMMON = {
    "proc/self/cgroup": "0::/user.slice/user-0.slice/session-1.scope\n",
    "proc/self/mountinfo": V2_MOUNTINFO,
    "proc/self/limits": limits(),
    "proc/pressure/memory": PSI,
    "proc/device-tree/model": "Orange Pi 5\x00",
    "proc/device-tree/compatible": "xunlong,orangepi-5\x00rockchip,rk3588s\x00",
    "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory hugetlb pids rdma misc\n",
    "sys/fs/cgroup/cgroup.subtree_control": "cpuset cpu io memory pids\n",
    "sys/devices/system/cpu/online": "0-7\n",
    "dev/dri/renderD128": "",
    "dev/dri/renderD129": "",
    "proc/sys/vm/overcommit_kbytes": "0\n",
    # The DDR controller's devfreq as the Rockchip BSP shows it (tests/fixtures/boards/README.md)
    "sys/class/devfreq/dmc/governor": "dmc_ondemand\n",
    "sys/class/devfreq/dmc/available_frequencies": "528000000 1068000000 1560000000 2112000000\n",
    "sys/class/devfreq/dmc/cur_freq": "528000000\n",
    "sys/class/devfreq/dmc/min_freq": "528000000\n",
    "sys/class/devfreq/dmc/max_freq": "2112000000\n",
}

# 8 GB Orange Pi 5 (RK3588S), Armbian, after `slmguard apply`.
RK3588_HARDENED = {
    **RK3588_COMMON,
    "proc/meminfo": meminfo(7_994_000, 7_100_000, 6_395_200, 1_500_000, cma_kb=2_097_152),
    "proc/swaps": "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n",
    "proc/cmdline": (
        "root=UUID=8d2c3d0e-5e4c-4b6f-9a59-0c1d2e3f4a5b rootwait rootfstype=ext4 "
        "console=ttyS2,1500000 consoleblank=0 loglevel=1 cma=2048M\n"
    ),
    "proc/sys/vm/swappiness": "0\n",
    "proc/sys/vm/overcommit_memory": "2\n",
    "proc/sys/vm/overcommit_ratio": "80\n",
    "boot/armbianEnv.txt": ARMBIAN_ENV_HARDENED,
    "etc/fstab": "UUID=8d2c3d0e-5e4c-4b6f-9a59-0c1d2e3f4a5b / ext4 defaults,noatime 0 1\n"
    "tmpfs /tmp tmpfs defaults,nosuid 0 0\n",
    "lib/systemd/system/armbian-zram-config.service": "[Unit]\nDescription=Armbian ZRAM\n",
    "etc/systemd/system/armbian-zram-config.service": Link("/dev/null"),
    "etc/default/armbian-zram-config": "# Armbian zram\nENABLED=false\n",
    "sys/kernel/debug/rknpu/version": "RKNPU driver: v0.9.6\n",
    "sys/kernel/debug/dma_buf/bufinfo": BUFINFO,
    "etc/systemd/system/slmguard.service": HARDENED_UNIT,
    "etc/systemd/system/multi-user.target.wants/slmguard.service": Link(
        "/etc/systemd/system/slmguard.service"
    ),
}

# The same board as Armbian ships it: zram swap at boot, a swap file, swappiness 100.
RK3588_STOCK = {
    **RK3588_COMMON,
    "proc/meminfo": meminfo(
        7_994_000, 6_900_000, 7_898_000, 2_100_000, cma_kb=65_536, swap_kb=3_997_000
    ),
    "proc/swaps": (
        "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
        "/dev/zram0                              partition\t3997000\t\t10240\t\t5\n"
        "/swapfile                               file\t\t1048572\t\t0\t\t-2\n"
    ),
    "proc/cmdline": "root=UUID=8d2c3d0e-5e4c-4b6f-9a59-0c1d2e3f4a5b rootwait rootfstype=ext4\n",
    "proc/sys/vm/swappiness": "100\n",
    "proc/sys/vm/overcommit_memory": "0\n",
    "proc/sys/vm/overcommit_ratio": "50\n",
    "boot/armbianEnv.txt": ARMBIAN_ENV_HARDENED.replace("extraargs=cma=2048M\n", ""),
    "etc/fstab": "UUID=8d2c3d0e-5e4c-4b6f-9a59-0c1d2e3f4a5b / ext4 defaults,noatime 0 1\n"
    "/swapfile none swap sw 0 0\n",
    "sys/block/zram0/disksize": "4092928000\n",
    "sys/block/zram0/mm_stat": (
        "10485760  2621440  3145728        0  3145728        0        0        0        0\n"
    ),
    "sys/block/zram0/comp_algorithm": "lzo lzo-rle lz4 [zstd]\n",
    "lib/systemd/system/armbian-zram-config.service": "[Unit]\nDescription=Armbian ZRAM\n",
    "etc/systemd/system/sysinit.target.wants/armbian-zram-config.service": Link(
        "/lib/systemd/system/armbian-zram-config.service"
    ),
    "etc/default/armbian-zram-config": "ENABLED=true\nSWAP=true\n",
}

JETSON_UNIT_DIR = "etc/systemd/system"

# Jetson Orin Nano 8 GB developer kit, JetPack 6 (L4T 36, Ubuntu 22.04, cgroup v2), stock.
JETSON = {
    "proc/self/cgroup": "0::/user.slice/user-1000.slice/session-3.scope\n",
    "proc/self/mountinfo": V2_MOUNTINFO,
    "proc/self/limits": limits("8388608"),
    "proc/pressure/memory": PSI,
    "proc/device-tree/model": "NVIDIA Jetson Orin Nano Developer Kit\x00",
    "proc/meminfo": meminfo(
        7_802_000, 6_200_000, 7_801_000, 3_000_000, cma_kb=262_144, swap_kb=3_900_000
    ),
    "proc/swaps": "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
    + "".join(
        f"/dev/zram{i}                              partition\t650000\t\t0\t\t5\n" for i in range(6)
    ),
    "proc/cmdline": "root=/dev/nvme0n1p1 rw rootwait rootfstype=ext4 mminit_loglevel=4 "
    "console=ttyTCU0,115200 firmware_class.path=/etc/firmware fbcon=map:0 nospectre_bhb\n",
    "proc/sys/vm/swappiness": "60\n",
    "proc/sys/vm/overcommit_memory": "0\n",
    "proc/sys/vm/overcommit_ratio": "50\n",
    "proc/sys/vm/overcommit_kbytes": "0\n",
    "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory hugetlb pids rdma misc\n",
    "sys/devices/system/cpu/online": "0-5\n",
    **{f"sys/block/zram{i}/disksize": "665600000\n" for i in range(6)},
    "dev/nvhost-ctrl": "",
    "dev/nvhost-ctrl-gpu": "",
    "dev/nvhost-gpu": "",
    "dev/nvmap": "",
    "dev/dri/renderD128": "",
    "boot/extlinux/extlinux.conf": (
        "TIMEOUT 30\nDEFAULT primary\n\nMENU TITLE L4T boot options\n\n"
        "LABEL primary\n      MENU LABEL primary kernel\n      LINUX /boot/Image\n"
        "      INITRD /boot/initrd\n      APPEND ${cbootargs} root=/dev/nvme0n1p1 rw rootwait "
        "rootfstype=ext4 mminit_loglevel=4 console=ttyTCU0,115200\n"
    ),
    "etc/fstab": "/dev/root / ext4 defaults 0 1\n",
    f"{JETSON_UNIT_DIR}/nvzramconfig.service": (
        "[Unit]\nDescription=ZRAM configuration\n\n[Service]\nType=oneshot\n"
        "ExecStart=/etc/systemd/nvzramconfig.sh\n\n[Install]\nWantedBy=multi-user.target\n"
    ),
    f"{JETSON_UNIT_DIR}/multi-user.target.wants/nvzramconfig.service": Link(
        "/etc/systemd/system/nvzramconfig.service"
    ),
}


def plan_for_rk3588(**changes: object) -> Plan:
    """The plan the hardened RK3588 tree satisfies (8 GB board, 4 big cores)."""
    kernel = KernelSettings(
        swappiness=0,
        overcommit_memory=2,
        overcommit_ratio=80,
        commit_charge_bytes=3 * GIB,
        cma_bytes=2 * GIB,
    )
    plan = Plan(
        model=ModelSpec(
            "qwen2.5-0.5b-instruct-q4_k_m",
            "qwen2",
            491 * MIB,
            24,
            32768,
            path="/var/lib/slmguard/models/qwen2.5-0.5b-instruct-q4_k_m.gguf",
            quant="Q4_K_M",
            sha256="6eb0ba4b5e8b1f0b3c1b0a3e2b6b0a7f0e5d3c9a8b7c6d5e4f3a2b1c0d9e8f7a",
        ),
        board=BoardSpec(
            "rk3588-8g",
            8 * 1000 * 1000 * 1000,
            cpus=tuple(range(8)),
            big_cores=(4, 5, 6, 7),
            npu_reserve_bytes=1 * GIB,
            device_nodes=("/dev/dri/renderD129",),
            boot_file="/boot/armbianEnv.txt",
        ),
        engine=EngineSettings(n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=4),
        limits=Limits(
            memory_high_bytes=5000 * MIB, memory_max_bytes=5600 * MIB, os_reserve_bytes=GIB
        ),
        kernel=kernel,
        cpu_affinity=(4, 5, 6, 7),
    )
    if not changes:
        return plan
    import dataclasses

    return dataclasses.replace(plan, **changes)  # type: ignore[arg-type]


# The plan apply installed beside the hardened tree's unit (its --plan).
RK3588_HARDENED["etc/slmguard/plan.json"] = dumps_plan(plan_for_rk3588())
# `slmguard apply --journal capped`'s drop-in: an SD card's journal (doctor's storage.journal).
RK3588_HARDENED["etc/systemd/journald.conf.d/50-slmguard.conf"] = journald_conf("capped")


# Board trees captured from public dumps of real boards (sources in
# tests/fixtures/boards/README.md): the kernel's own files, copied as they are.
BOARD_FIXTURES = Path(__file__).parent / "fixtures" / "boards"


def copy_board(name: str, root: Path) -> Path:
    """Copy ``tests/fixtures/boards/<name>`` to ``root`` (a fresh directory), its links as
    links (``sys/class/*`` and ``cpuN/cpufreq`` point into ``sys/devices`` as on a board)."""
    import shutil

    shutil.copytree(BOARD_FIXTURES / name, root, symlinks=True, dirs_exist_ok=True)
    return root
