"""systemd units from the plan: the server, the watchdog, its crash hook, slices.

Owns the text of every unit and drop-in apply writes (the server, the watcher, the
``OnFailure=`` collector, ``slmguard-recover.service``, the slices, the neighbours'
drop-ins): each function takes the plan and :class:`UnitOptions` and returns the file's
content, every value escaped for systemd. The choices and why each is there
(``StartLimit*`` in ``[Unit]``, ``Type=notify`` with ``WatchdogSec``,
``OOMScoreAdjust=-500`` with ``OOMPolicy=continue``, the private ``RuntimeDirectory=``,
the shader cache in ``StateDirectory=`` and no ``MemoryDenyWriteExecute=``, no
``ProcSubset=pid``, ``LoadCredential=`` for the admin token, ``OnFailure=`` across
systemd versions, the early-boot recover unit) are told in ``docs/deploy.md``; keep
them in step.

Pure text: it must not read the host or write a file (``apply`` does), nor decide a
figure the plan has not (sizes, CPUs and limits come from the plan).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slmguard.deploy import escape
from slmguard.deploy.escape import Verbatim
from slmguard.plan.schema import NEIGHBOUR_UNIT_PATTERN, Neighbour, Plan

UNIT_DIR = "/etc/systemd/system"
WANTS_DIR = f"{UNIT_DIR}/multi-user.target.wants"
SYSINIT_WANTS_DIR = f"{UNIT_DIR}/sysinit.target.wants"
PLAN_PATH = "/etc/slmguard/plan.json"
SERVICE = "slmguard.service"
WATCH_SERVICE = "slmguard-watch.service"
CRASHDUMP_SERVICE = "slmguard-crashdump.service"
RECOVER_SERVICE = "slmguard-recover.service"
INFERENCE_SLICE = "slmguard.slice"
PROTECT_DROPIN = "50-slmguard-protect.conf"
STATE_DIR = "/var/lib/slmguard"
#: Under STATE_DIR: a Vulkan engine's shader cache (serve's ``llamaserver.SHADER_CACHE_DIR``).
SHADER_CACHE_DIR = "shader-cache"
#: The admin token for the governor's /api/v1 routes (``apply`` creates it, 0600 root).
ADMIN_TOKEN_PATH = "/etc/slmguard/admin-token"
#: The credential's name: the file the services read is ``%d/admin-token``.
ADMIN_CREDENTIAL = "admin-token"
#: Where the served API is: the server's default bind (loopback, port 8080).
LOOPBACK = "127.0.0.1"
PORT = 8080
SERVER_URL = f"http://{LOOPBACK}:{PORT}"
#: The API key of a LAN listener (``apply`` creates it, 0600 root) and its credential.
API_KEY_PATH = "/etc/slmguard/api-key"
API_KEY_CREDENTIAL = "api-key"

#: Most engine threads a unit sets (OpenMP/BLAS thread counts beyond it are a bad plan).
MAX_THREADS = 1024
#: Thread-count variables read by OpenMP and the BLAS libraries llama.cpp may link.
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")

#: Device directories a board spec may name, as the device classes DeviceAllow=
#: takes for them (a directory is not a device node; class names as in /proc/devices,
#: globs allowed). L4T's nvgpu registers its /dev/nvgpu/igpu0/* and nvhost-*-gpu nodes
#: in char regions named after the GPU's platform device (``alloc_chrdev_region(...,
#: dev_name(dev))`` in nvgpu's os/linux/ioctl.c), ``17000000.gpu`` on the Orin.
DEVICE_CLASSES = {
    "/dev/dri": "char-drm",
    "/dev/dma_heap": "char-dma_heap",
    "/dev/nvgpu": "char-*.gpu",
}

_HEADER = (
    "# Written by slmguard from the plan for {model} on {board}.\n"
    "# Change the plan and run `slmguard apply` again; `slmguard rollback` undoes it.\n"
)


@dataclass(frozen=True)
class UnitOptions:
    """What the units need besides the plan.

    Example::

        UnitOptions(exec_path="/usr/local/bin/slmguard", protect=("nginx.service",))
    """

    exec_path: str = "/usr/local/bin/slmguard"
    plan_path: str = PLAN_PATH
    user: str = "slmguard"
    business_slice: str = "business.slice"
    protect: tuple[str, ...] = ()
    #: Where the server listens. Not loopback: a LAN listener, which gets the API
    #: key apply makes on the board and lets in only ``allow`` (and localhost).
    host: str = LOOPBACK
    port: int = PORT
    allow: tuple[str, ...] = ()  # networks for IPAddressAllow= (CIDR), besides localhost
    #: A Kubernetes node: the kernel, swap and boot settings and the model, no units.
    kubernetes_node: bool = False
    #: The board's storage (``slmguard.deploy.storage``): the journal kept, capped on
    #: disk or in RAM only; noatime on the state directory's filesystems.
    journal: str = "keep"
    noatime: bool = False

    @property
    def lan(self) -> bool:
        """Whether the server listens beyond loopback (and needs its API key)."""
        return self.host not in (LOOPBACK, "::1", "localhost")

    @property
    def server_url(self) -> str:
        """The server as the watcher (and the Ansible gate) reach it: always loopback."""
        return f"http://{LOOPBACK}:{self.port}"


def systemd_size(n_bytes: int) -> str:
    """A byte count as systemd reads it (K/M/G are powers of 1024), exact."""
    for suffix, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n_bytes > 0 and n_bytes % (1 << shift) == 0:
            return f"{n_bytes >> shift}{suffix}"
    return str(n_bytes)


def cpu_list(cpus: tuple[int, ...] | list[int]) -> str:
    """``(0, 1, 2, 3, 6)`` -> ``"0-3 6"``; systemd's CPUAffinity/AllowedCPUs syntax."""
    out: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return " ".join(out)


def _header(plan: Plan) -> str:
    """The comment every file starts with; the names as labels (one line, no syntax)."""
    return _HEADER.format(model=escape.label(plan.model.name), board=escape.label(plan.board.name))


def _size(n_bytes: int, where: str, minimum: int = 1) -> str:
    """A checked byte count from the plan, as systemd reads it."""
    return systemd_size(escape.bounded_int(n_bytes, where, minimum, (1 << 63) - 1))


def _cpus(cpus: tuple[int, ...], where: str) -> str:
    return cpu_list(escape.cpu_ids(cpus, where))


def _exec(opts: UnitOptions, *args: str | Verbatim) -> str:
    """An ExecStart= line running slmguard with ``args``, every word escaped."""
    return "ExecStart=" + escape.exec_line([opts.exec_path, *args], "ExecStart")


def _home_paths_used(plan: Plan, opts: UnitOptions) -> bool:
    paths = [opts.exec_path, plan.model.path or "", plan.projector.path if plan.projector else ""]
    return any(p.startswith(("/home/", "/root/", "/run/user/")) for p in paths)


def _sandbox(*, protect_home: str) -> list[str]:
    """The hardening shared by all slmguard units (see systemd.exec(5))."""
    return [
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        f"ProtectHome={protect_home}",
        "PrivateTmp=yes",
        "PrivateMounts=yes",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "ProtectProc=invisible",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "RemoveIPC=yes",
        "UMask=0077",
        "SystemCallArchitectures=native",
        "SystemCallFilter=@system-service",
        "SystemCallFilter=~@privileged",
        "SystemCallErrorNumber=EPERM",
    ]


def _credential_lines() -> list[str]:
    return [
        "# The admin token (root's, mode 0600) handed to the transient user as a credential.",
        f"LoadCredential={ADMIN_CREDENTIAL}:{ADMIN_TOKEN_PATH}",
    ]


def _listen_args(opts: UnitOptions) -> list[str | Verbatim]:
    """The server's listener: nothing for the default, else host, port and the API key."""
    args: list[str | Verbatim] = []
    if opts.lan:
        args += ["--host", escape.listen_address(opts.host, "--listen")]
    if opts.port != PORT or opts.lan:
        args += ["--port", str(escape.bounded_int(opts.port, "port", 1, 65535))]
    if opts.lan:
        args += ["--api-key-file", Verbatim(f"%d/{API_KEY_CREDENTIAL}")]
    return args


def _token_flag() -> tuple[str, Verbatim]:
    """``--admin-token-file %d/admin-token``: ``%d`` is the unit's credentials directory."""
    return "--admin-token-file", Verbatim(f"%d/{ADMIN_CREDENTIAL}")


def _projector_args(plan: Plan) -> list[str | Verbatim]:
    """``--mmproj FILE`` for a plan with a vision projector (serve checks the file against
    the plan's size and sha256 and passes it to the engine), else nothing."""
    v = plan.projector
    if v is None:
        return []
    return ["--mmproj", v.path]  # each word escaped by exec_line


def _projector_lines(plan: Plan) -> list[str]:
    """What the engine is given for the projector, as a comment (the plan holds it)."""
    v = plan.projector
    if v is None:
        return []
    tokens = (
        f"--image-max-tokens {v.image_max_tokens}"
        if v.image_max_tokens is not None
        else f"{v.tokens_per_image} tokens an image, fixed by the projector: no --image-max-tokens"
    )
    where = "on the GPU" if v.offload else "on the host: --no-mmproj-offload"
    return [
        f"# Vision: the engine gets --mmproj ({where}), {tokens}; a request",
        f"# carries at most {v.max_images} images of {v.max_image_bytes} bytes, "
        f"{v.max_image_side} pixels a side, {v.max_image_pixels} pixels (400 above).",
    ]


def _service_lifecycle(plan: Plan, opts: UnitOptions) -> list[str]:
    """How the server is started, watched, stopped and restarted."""
    args = [*_projector_args(plan), *_listen_args(opts), *_token_flag()]
    return [
        "Type=notify",
        "NotifyAccess=main",
        *_projector_lines(plan),
        _exec(opts, "serve", "--plan", opts.plan_path, *args),
        *_credential_lines(),
        *(
            [
                "# A LAN listener: its API key (made on the board by apply, 0600 root).",
                f"LoadCredential={API_KEY_CREDENTIAL}:{API_KEY_PATH}",
            ]
            if opts.lan
            else []
        ),
        f"Slice={INFERENCE_SLICE}",
        "WatchdogSec=30",
        "TimeoutStartSec=300",
        "TimeoutStopSec=30",
        "# SIGTERM to the front only: it drains requests and stops its engine itself.",
        "KillMode=mixed",
        "Restart=on-failure",
        "RestartSec=5",
    ]


def _service_resources(plan: Plan) -> list[str]:
    """Memory limits, the OOM killer's order, process limits, cores and thread counts."""
    lim, eng = plan.limits, plan.engine
    lines = [
        "# Memory: throttle at MemoryHigh, OOM-kill inside the unit at MemoryMax, never swap.",
        "MemoryAccounting=yes",
        f"MemoryHigh={_size(lim.memory_high_bytes, 'plan.limits.memory_high_bytes')}",
        f"MemoryMax={_size(lim.memory_max_bytes, 'plan.limits.memory_max_bytes')}",
        "MemorySwapMax=0",
        "# The front starts at -500 (it cannot lower itself without CAP_SYS_RESOURCE); the",
        "# engine raises its own oom_score_adj to 1000 and is the victim, in the unit's",
        "# cgroup and system-wide. OOMPolicy=continue keeps the front to restart it.",
        "OOMScoreAdjust=-500",
        "OOMPolicy=continue",
        "TasksMax=256",
        "LimitNOFILE=16384",
        "# A core of a multi-GB process would fill the flash; faulthandler leaves tracebacks.",
        "LimitCORE=0",
    ]
    if eng.use_mlock:
        lines += [
            "# use_mlock: the weights are locked; allow locking up to MemoryMax.",
            f"LimitMEMLOCK={_size(lim.memory_max_bytes, 'plan.limits.memory_max_bytes')}",
        ]
    if plan.cpu_affinity:
        lines.append(f"CPUAffinity={_cpus(plan.cpu_affinity, 'plan.cpu_affinity')}")
    n_threads = escape.bounded_int(eng.n_threads, "plan.engine.n_threads", 1, MAX_THREADS)
    threads = escape.environment(((name, str(n_threads)) for name in THREAD_ENV), "Environment")
    return [
        *lines,
        f"Environment={threads}",
        f"Environment=SLMGUARD_STATE_DIR={STATE_DIR} SLMGUARD_MODEL_DIR={STATE_DIR}/models",
        "# glibc makes an arena per thread; two keep RSS predictable on small boards.",
        "Environment=MALLOC_ARENA_MAX=2 PYTHONDONTWRITEBYTECODE=1",
    ]


def _service_identity(plan: Plan, opts: UnitOptions) -> list[str]:
    """The transient user, its groups and state, no capabilities, loopback only."""
    lines = [
        "# A transient user: nothing is added to /etc/passwd, so rollback leaves /etc as it",
        "# was. Units with the same User= share it while they run.",
        "DynamicUser=yes",
        f"User={escape.unit_value(opts.user, 'User')}",
    ]
    groups = plan.board.device_groups
    if groups:
        names = (
            escape.group_name(g, f"plan.board.device_groups[{i}]") for i, g in enumerate(groups)
        )
        lines.append(f"SupplementaryGroups={' '.join(names)}")
    return [
        *lines,
        "StateDirectory=slmguard",
        "StateDirectoryMode=0750",
        *_shader_cache_lines(plan),
        "# The engine's socket and per-start key: the service user's alone.",
        "RuntimeDirectory=slmguard",
        "RuntimeDirectoryMode=0700",
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        *_address_lines(opts),
    ]


def _shader_cache_lines(plan: Plan) -> list[str]:
    """Where a Vulkan engine's compiled shaders persist: serve points Mesa's cache at the
    state directory (``serve.llamaserver.engine_env``), the one place of this unit the
    transient user may write besides its runtime directory; its home (``/``) is not."""
    if plan.engine.backend != "vulkan":
        return []
    return [
        f"# The Vulkan engine's compiled shaders persist in {STATE_DIR}/{SHADER_CACHE_DIR}",
        "# (serve sets MESA_SHADER_CACHE_DIR; the home of this user is not writable): only",
        "# the first start after an engine or driver upgrade compiles them.",
    ]


def _address_lines(opts: UnitOptions) -> list[str]:
    """Who may connect: localhost, and the LAN networks of a LAN listener."""
    if not opts.lan:
        return [
            "# Loopback only (apply --listen HOST --allow NETWORK serves a LAN, with an API key).",
            "IPAddressDeny=any",
            "IPAddressAllow=localhost",
        ]
    nets = " ".join(escape.network(n, f"--allow[{i}]") for i, n in enumerate(opts.allow))
    return [
        "# A LAN listener: loopback and these networks only; every request needs the API key.",
        "IPAddressDeny=any",
        f"IPAddressAllow=localhost {nets}",
    ]


def _service_devices(plan: Plan) -> list[str]:
    """The board's NPU/GPU nodes (as device classes for directories), or no devices."""
    nodes = [
        escape.device_node(n, f"plan.board.device_nodes[{i}]")
        for i, n in enumerate(plan.board.device_nodes)
    ]
    if not nodes:
        return ["PrivateDevices=yes", "DevicePolicy=closed"]
    allowed = dict.fromkeys(DEVICE_CLASSES.get(n.rstrip("/"), n) for n in nodes)
    return [
        "# The NPU/GPU nodes of this board and nothing else.",
        "DevicePolicy=closed",
        *(f"DeviceAllow={node} rw" for node in allowed),
    ]


def service_unit(plan: Plan, opts: UnitOptions) -> str:
    """``slmguard.service``: the server, limited, sandboxed, restarted, watched."""
    home = "read-only" if _home_paths_used(plan, opts) else "yes"
    unit = [
        "[Unit]",
        "Description="
        + escape.unit_value(
            f"slmguard: {escape.label(plan.model.name)} behind an OpenAI-compatible API "
            "with a memory governor",
            "plan.model.name",
        ),
        "After=network-online.target",
        "Wants=network-online.target",
        "# Restart limit: at most 3 starts in 60 s, then the unit fails (and OnFailure runs).",
        "StartLimitIntervalSec=60",
        "StartLimitBurst=3",
        f"OnFailure={CRASHDUMP_SERVICE}",
        "",
        "[Service]",
        *_service_lifecycle(plan, opts),
        "",
        *_service_resources(plan),
        "",
        *_service_identity(plan, opts),
        *_service_devices(plan),
        "ProtectKernelLogs=yes",
        *_sandbox(protect_home=home),
        "",
        "[Install]",
        "WantedBy=multi-user.target",
    ]
    return _header(plan) + "\n".join(unit) + "\n"


def _watch_common(plan: Plan, opts: UnitOptions) -> list[str]:
    home = "read-only" if _home_paths_used(plan, opts) else "yes"
    return [
        "DynamicUser=yes",
        f"User={escape.unit_value(opts.user, 'User')}",
        "# systemd-journal: read the journal tail for crash bundles.",
        "SupplementaryGroups=systemd-journal",
        "StateDirectory=slmguard",
        "StateDirectoryMode=0750",
        f"Environment=SLMGUARD_STATE_DIR={STATE_DIR}",
        "# /dev/kmsg is where OOM-kill reports are; reading it needs CAP_SYSLOG",
        "# when kernel.dmesg_restrict=1.",
        "CapabilityBoundingSet=CAP_SYSLOG",
        "AmbientCapabilities=CAP_SYSLOG",
        "DevicePolicy=closed",
        "DeviceAllow=/dev/kmsg r",
        "MemoryDenyWriteExecute=yes",
        *_sandbox(protect_home=home),
    ]


def watch_unit(plan: Plan, opts: UnitOptions) -> str:
    """``slmguard-watch.service``: small, hard to kill, always restarted (like earlyoom's)."""
    unit = [
        "[Unit]",
        "Description=slmguard watch: OOM kills, memory pressure and leaks of slmguard.service",
        f"After={SERVICE}",
        "",
        "# The watcher never exits on its own: bring it back whatever happened, forever.",
        "StartLimitIntervalSec=0",
        "",
        "[Service]",
        "Type=simple",
        _exec(
            opts,
            "watch",
            "--plan",
            opts.plan_path,
            "--unit",
            SERVICE,
            "--server",
            opts.server_url,
            *_token_flag(),
        ),
        *_credential_lines(),
        "Restart=always",
        "RestartSec=5",
        "MemoryAccounting=yes",
        "MemoryMax=64M",
        "MemorySwapMax=0",
        "TasksMax=16",
        "# Below everything else in the OOM killer's order, but still killable.",
        "OOMScoreAdjust=-900",
        "Nice=-5",
        *_watch_common(plan, opts),
        "",
        "[Install]",
        "WantedBy=multi-user.target",
    ]
    return _header(plan) + "\n".join(unit) + "\n"


def crashdump_unit(plan: Plan, opts: UnitOptions) -> str:
    """``slmguard-crashdump.service``: OnFailure hook writing a crash bundle once."""
    unit = [
        "[Unit]",
        "Description=slmguard crash bundle after slmguard.service failed",
        "",
        "[Service]",
        "Type=oneshot",
        _exec(opts, "watch", "--collect", "--plan", opts.plan_path, "--unit", SERVICE),
        "TimeoutStartSec=120",
        "MemoryAccounting=yes",
        "MemoryMax=128M",
        "MemorySwapMax=0",
        "OOMScoreAdjust=-900",
        *_watch_common(plan, opts),
    ]
    return _header(plan) + "\n".join(unit) + "\n"


def recover_unit(opts: UnitOptions, manifest: str) -> str:
    """``slmguard-recover.service``: at boot, an apply a power cut stopped is undone.

    Runs ``slmguard rollback --if-unfinished`` once per boot, after the local file
    systems and before ``sysinit.target`` (as ``systemd-tmpfiles-setup`` does) and the
    services, so they start on the deployment that finished last; nothing when the
    last apply finished (``manifest``: apply's, without which it does not run).
    Plan-independent text: a new plan never rewrites it.
    """
    unit = [
        "# Written by slmguard apply (the same for every plan); `slmguard rollback` removes it.",
        "[Unit]",
        "Description=slmguard: undo an apply a power cut stopped (back to the last finished one)",
        "DefaultDependencies=no",
        "After=local-fs.target",
        f"Before=sysinit.target shutdown.target {SERVICE} {WATCH_SERVICE}",
        "Conflicts=shutdown.target",
        f"ConditionPathExists={escape.unit_value(manifest, 'ConditionPathExists')}",
        "",
        "[Service]",
        "Type=oneshot",
        _exec(opts, "rollback", "--if-unfinished"),
        "TimeoutStartSec=300",
        "# Root's repair of /etc, /boot and the model (what apply wrote): no ProtectSystem=",
        "# (systemd finds it not appropriate this early anyway) and kernel tunables writable",
        "# (sysctl --system). Everything else closed: exposure 1.6 (systemd-analyze 252).",
        "CapabilityBoundingSet=CAP_CHOWN CAP_FOWNER CAP_DAC_OVERRIDE",
        "NoNewPrivileges=yes",
        "PrivateNetwork=yes",
        "IPAddressDeny=any",
        "RestrictAddressFamilies=AF_UNIX",
        "PrivateDevices=yes",
        "DevicePolicy=closed",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "ProtectControlGroups=yes",
        "ProtectProc=invisible",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "MemoryDenyWriteExecute=yes",
        "KeyringMode=private",
        "UMask=0077",
        "SystemCallArchitectures=native",
        "SystemCallFilter=@system-service",
        "SystemCallFilter=~@resources @mount @swap @reboot @module @raw-io @clock "
        "@cpu-emulation @debug @obsolete",
        "",
        "[Install]",
        "WantedBy=sysinit.target",
    ]
    return "\n".join(unit) + "\n"


def inference_slice(plan: Plan) -> str:
    """``slmguard.slice``: the inference zone, capped at the plan's MemoryMax."""
    lines = [
        "[Unit]",
        "Description=slmguard inference zone (the model server; capped at the plan's MemoryMax)",
        "Before=slices.target",
        "",
        "[Slice]",
        "MemoryAccounting=yes",
        f"MemoryMax={_size(plan.limits.memory_max_bytes, 'plan.limits.memory_max_bytes')}",
        "MemorySwapMax=0",
    ]
    if plan.cpu_affinity:
        lines.append(f"AllowedCPUs={_cpus(plan.cpu_affinity, 'plan.cpu_affinity')}")
    return _header(plan) + "\n".join(lines) + "\n"


def business_guarantee_bytes(plan: Plan) -> tuple[int, int]:
    """(MemoryMin, MemoryLow) of the business zone.

    MemoryMin is the plan's business reserve (a hard guarantee; it holds the declared
    neighbours' memory, less that of the neighbours protected by MemoryLow= only), so
    the slice can pass each neighbour's MemoryMin= on (cgroup2 distributes a parent's
    protection among its children); MemoryLow is everything that is neither the
    inference zone's MemoryMax nor the OS reserve (best-effort protection), never below
    MemoryMin.
    """
    lim = plan.limits
    spare = plan.board.ram_bytes - lim.memory_max_bytes - lim.os_reserve_bytes
    low_only = sum(n.memory_bytes for n in plan.neighbours if n.protection == "low")
    hard = max(0, lim.business_reserve_bytes - low_only)
    return hard, max(spare, lim.business_reserve_bytes)


def business_cpus(plan: Plan) -> tuple[int, ...]:
    """The board's CPUs the model does not use."""
    used = set(plan.cpu_affinity)
    return tuple(c for c in plan.board.cpus if c not in used) if used else ()


def business_slice(plan: Plan, opts: UnitOptions) -> str:
    """The business-logic protection zone: guaranteed memory, own cores, more CPU weight."""
    mem_min, mem_low = business_guarantee_bytes(plan)
    lines = [
        "[Unit]",
        "Description=Business logic protected from the slmguard inference zone",
        "Before=slices.target",
        "",
        "[Slice]",
        "MemoryAccounting=yes",
        "# Protection reaches the services inside through cgroup2's memory_recursiveprot",
        "# (systemd >= 247 mounts with it where the kernel has it, Linux >= 5.7).",
        f"MemoryMin={_size(mem_min, 'plan.limits.business_reserve_bytes', minimum=0)}",
        f"MemoryLow={_size(mem_low, 'plan.limits.business_reserve_bytes', minimum=0)}",
        "CPUWeight=200",
    ]
    cpus = business_cpus(plan)
    if cpus:
        lines.append(f"AllowedCPUs={_cpus(cpus, 'plan.board.cpus')}")
    return _header(plan) + "\n".join(lines) + "\n"


def protect_dropin(plan: Plan, opts: UnitOptions) -> str:
    """Drop-in that moves an existing service into the business slice."""
    return _header(plan) + f"[Service]\nSlice={escape.unit_value(opts.business_slice, 'Slice')}\n"


def neighbour_units(plan: Plan) -> tuple[tuple[int, Neighbour], ...]:
    """The plan's neighbours that name a unit (with their index), each name one systemd
    takes as a service and that is none of slmguard's own: refused otherwise (this layer
    does not rely on the plan reader)."""
    out = []
    for i, n in enumerate(plan.neighbours):
        if n.unit is None:
            continue
        if (
            not escape.is_unit_name(n.unit, ".service")
            or re.fullmatch(NEIGHBOUR_UNIT_PATTERN, n.unit) is None
        ):
            raise escape.refuse(f"plan.neighbours[{i}].unit", n.unit, "is not a service name")
        if n.unit in (SERVICE, WATCH_SERVICE, CRASHDUMP_SERVICE):
            raise escape.refuse(f"plan.neighbours[{i}].unit", n.unit, "is one of slmguard's own")
        out.append((i, n))
    return tuple(out)


def neighbour_dropin(plan: Plan, opts: UnitOptions, index: int, n: Neighbour) -> str:
    """Drop-in that moves a neighbour into the business slice, protected for its memory.

    Start-up order does not matter (docs/deploy.md): the engines allocate what the plan
    fixes, not what is free when they load, and the memory is split before anything
    starts: slmguard.slice is capped at MemoryMax, this unit is guaranteed its share."""
    key = "MemoryMin" if n.protection == "min" else "MemoryLow"
    size = _size(n.memory_bytes, f"plan.neighbours[{index}].memory_bytes")
    lines = [
        "[Service]",
        f"# {escape.label(n.name)}: the plan holds {size} for it beside the models; the kernel",
        "# does not reclaim it below that for the inference zone"
        + (" (MemoryMin=)." if key == "MemoryMin" else " while others can give (MemoryLow=)."),
        f"Slice={escape.unit_value(opts.business_slice, 'Slice')}",
        "MemoryAccounting=yes",
        f"{key}={size}",
    ]
    return _header(plan) + "\n".join(lines) + "\n"
