"""GPU trees the captured boards do not cover, and an engine process with GPU handles.

``RK3588_PANTHOR``: an RK3588 on a mainline kernel (6.12), where the Mali-G610 is
a DRM render node driven by ``panthor`` and Mesa's PanVK is the Vulkan driver
(``panfrost_icd``); composed from the kernel's formats: the platform uevent
(``DRIVER=panthor``, ``OF_COMPATIBLE_0=rockchip,rk3588-mali``,
``OF_COMPATIBLE_1=arm,mali-valhall-csf`` as in ``rk3588-base.dtsi``), Mesa's
ICD manifest. ``LAVAPIPE_HOST``: this kind of machine, no GPU and Mesa's CPU
Vulkan driver.

:func:`engine_process` writes ``proc/<pid>`` for an engine holding DRM fds
(symlinks to the render node, fdinfo in ``drm-usage-stats.rst``'s keys as
``drm_print_memory_stats`` prints them: ``drm-total-memory:\\t<n> KiB``), a
DMA-BUF fd and an ordinary file.
"""

from __future__ import annotations

from hosttree import Link, Tree

KIB = 1024
MIB = 1024 * KIB

RK3588_PANTHOR: Tree = {
    "proc/device-tree/model": "Radxa ROCK 5B\x00",
    "proc/sys/kernel/osrelease": "6.12.1-edge-rockchip-rk3588\n",
    "dev/dri/card0": "",
    "dev/dri/card1": "",
    "dev/dri/renderD128": "",
    "dev/dri/renderD129": "",
    "sys/class/drm/renderD128/device/uevent": (
        "DRIVER=panthor\nOF_NAME=gpu\nOF_FULLNAME=/gpu@fb000000\n"
        "OF_COMPATIBLE_0=rockchip,rk3588-mali\nOF_COMPATIBLE_1=arm,mali-valhall-csf\n"
        "OF_COMPATIBLE_N=2\n"
    ),
    "sys/class/drm/renderD129/device/uevent": (
        "DRIVER=rockchip-drm\nOF_NAME=display-subsystem\n"
        "OF_COMPATIBLE_0=rockchip,display-subsystem\nOF_COMPATIBLE_N=1\n"
    ),
    "usr/share/vulkan/icd.d/panfrost_icd.aarch64.json": (
        '{"ICD": {"api_version": "1.4.305", '
        '"library_path": "/usr/lib/aarch64-linux-gnu/libvulkan_panfrost.so"}, '
        '"file_format_version": "1.0.1"}\n'
    ),
    "etc/group": "root:x:0:\nvideo:x:44:\nrender:x:992:\n",
}

LAVAPIPE_HOST: Tree = {
    "proc/sys/kernel/osrelease": "6.1.0-28-amd64\n",
    "usr/share/vulkan/icd.d/lvp_icd.x86_64.json": (
        '{"ICD": {"api_version": "1.3.230", '
        '"library_path": "/usr/lib/x86_64-linux-gnu/libvulkan_lvp.so"}, '
        '"file_format_version": "1.0.0"}\n'
    ),
    "etc/group": "root:x:0:\n",
}

V3D_FDINFO = (
    "pos:\t0\nflags:\t02100002\nmnt_id:\t24\nino:\t512\n"
    "drm-driver:\tv3d\ndrm-client-id:\t17\n"
    "drm-engine-bin: \t2093110 ns\nv3d-jobs-bin: \t12 jobs\n"
    "drm-engine-render: \t9310442 ns\nv3d-jobs-render: \t12 jobs\n"
    "drm-engine-tfu: \t0 ns\nv3d-jobs-tfu: \t0 jobs\n"
    "drm-engine-csd: \t48120330112 ns\nv3d-jobs-csd: \t8811 jobs\n"
    "drm-engine-cache_clean: \t10331 ns\nv3d-jobs-cache_clean: \t8811 jobs\n"
    "drm-total-memory:\t412704 KiB\ndrm-shared-memory:\t0\n"
    "drm-resident-memory:\t401408 KiB\ndrm-purgeable-memory:\t0\n"
)

PANTHOR_FDINFO = (
    "pos:\t0\nflags:\t02100002\nmnt_id:\t24\nino:\t611\n"
    "drm-driver:\tpanthor\ndrm-client-id:\t3\n"
    "drm-engine-panthor:\t83719220231 ns\ndrm-cycles-panthor:\t79411310377\n"
    "drm-maxfreq-panthor:\t1000000000 Hz\ndrm-curfreq-panthor:\t1000000000 Hz\n"
    "drm-total-memory:\t612 MiB\ndrm-shared-memory:\t0\ndrm-active-memory:\t0\n"
    "drm-resident-memory:\t590 MiB\ndrm-purgeable-memory:\t0\n"
    "panthor-resident-memory:\t10312 KiB\npanthor-active-memory:\t0\n"
)


def engine_process(
    pid: int,
    drm_fdinfo: str,
    node: str = "/dev/dri/renderD128",
    *,
    comm: str = "llama-server",
    dup_fds: int = 1,
    dmabuf_bytes: int = 0,
) -> Tree:
    """``proc/<pid>`` of an engine with ``dup_fds`` fds on one DRM client, one DMA-BUF
    of ``dmabuf_bytes`` (when not 0) and its model file open."""
    base = f"proc/{pid}"
    tree: dict[str, str | bytes | Link | None] = {
        f"{base}/comm": comm + "\n",
        f"{base}/stat": f"{pid} ({comm}) S 1 {pid} {pid} 0 -1 4194560\n",
        f"{base}/fd/3": Link("/var/lib/slmguard/models/m.gguf"),
        f"{base}/fdinfo/3": "pos:\t0\nflags:\t0100000\nmnt_id:\t29\nino:\t77\n",
    }
    for i in range(dup_fds):
        fd = 10 + i
        tree[f"{base}/fd/{fd}"] = Link(node)
        tree[f"{base}/fdinfo/{fd}"] = drm_fdinfo
    if dmabuf_bytes:
        tree[f"{base}/fd/40"] = Link("/dmabuf:")
        tree[f"{base}/fdinfo/40"] = (
            f"pos:\t0\nflags:\t02\nmnt_id:\t15\nino:\t900\nsize:\t{dmabuf_bytes}\n"
            "count:\t1\nexp_name:\tsystem\nname:\t\n"
        )
    return tree
