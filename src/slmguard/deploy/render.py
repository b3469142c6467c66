"""The deployment as files: what ``render`` shows and ``apply`` writes.

Pure: from a :class:`~slmguard.plan.schema.Plan`, :class:`RenderOptions` and (for
edits of files that already exist) their current text, produce
:class:`RenderedFile` values at absolute destination paths. Refusals happen
here, before anything is written, as :class:`~slmguard.errors.RefusedError`
with the numbers in ``facts``:

- the inference zone's MemoryMax above RAM minus the OS reserve (the plan's RAM,
  and the target's MemTotal when apply can read it);
- MemoryMax + the business zone's guarantee + the OS reserve above RAM;
- a CMA pool above half of RAM;
- ``vm.overcommit_memory = 2`` with a CommitLimit that would not admit the
  planned commit charge (CommitLimit = (RAM - huge pages) * ratio / 100 + swap;
  swap counts as 0 because the deployment turns it off);
- a boot file that cannot be parsed, or an edit leaving it without ``root=``.

One file is not rendered: the admin token (``/etc/slmguard/admin-token``) is
a :class:`RenderedFile` with ``secret_bytes`` set and no content. Only
``apply`` makes its random bytes, and only when the file is missing; a token
that is there is kept as it is.

The unit texts are in :mod:`slmguard.deploy.units`, sysctl/swap/zram in
:mod:`slmguard.deploy.system`, boot files in :mod:`slmguard.host.bootfiles`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slmguard.deploy.system import (
    SWAP_SERVICES,
    ZRAM_GENERATOR_CONF,
    disable_fstab_swap,
    sysctl_conf,
)
from slmguard.deploy.units import (
    ADMIN_TOKEN_PATH,
    CRASHDUMP_SERVICE,
    INFERENCE_SLICE,
    PROTECT_DROPIN,
    SERVICE,
    WATCH_SERVICE,
    UnitOptions,
    business_guarantee_bytes,
    business_slice,
    crashdump_unit,
    inference_slice,
    protect_dropin,
    service_unit,
    watch_unit,
)
from slmguard.errors import BootFileError, RefusedError, UsageError
from slmguard.host import bootfiles, kernelargs
from slmguard.plan.schema import Plan, dumps_plan

UNIT_DIR = "/etc/systemd/system"
PLAN_PATH = "/etc/slmguard/plan.json"
SYSCTL_PATH = "/etc/sysctl.d/99-slmguard.conf"
ZRAM_GENERATOR_PATH = "/etc/systemd/zram-generator.conf"
FSTAB_PATH = "/etc/fstab"
WANTS_DIR = f"{UNIT_DIR}/multi-user.target.wants"

# Unit names: systemd's allowed characters. Slices: no '-', which would nest
# the slice under another one (a-b.slice lives inside a.slice).
_SERVICE_NAME = re.compile(r"^[A-Za-z0-9:_.\\@-]+\.service$")
_SLICE_NAME = re.compile(r"^[A-Za-z0-9_]+\.slice$")
_OWN_UNITS = {SERVICE, WATCH_SERVICE, CRASHDUMP_SERVICE}

MiB = 1 << 20

#: Random bytes in a generated admin token (``secrets.token_urlsafe``: 43 characters).
ADMIN_TOKEN_ENTROPY_BYTES = 32


@dataclass(frozen=True)
class RenderedFile:
    """One destination path and what should be there: text, a symlink, or a secret.

    A secret (``secret_bytes`` set: that many random bytes, URL-safe base64)
    has no content here: apply generates it when the path does not exist and
    never replaces one that does.
    """

    path: str  # absolute destination, e.g. /etc/systemd/system/slmguard.service
    content: bytes | None = None
    link: str | None = None  # symlink target (masking: /dev/null)
    mode: int = 0o644
    why: str = ""
    secret_bytes: int | None = None

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.content, self.link, self.secret_bytes)]
        if sum(given) != 1:
            raise ValueError(f"{self.path}: give exactly one of content, link and secret_bytes")

    @property
    def is_secret(self) -> bool:
        return self.secret_bytes is not None


def secret_file_bytes(entropy_bytes: int) -> int:
    """Size of the file apply writes for a secret: the base64url text and a newline."""
    return -(-4 * entropy_bytes // 3) + 1


RenderOptions = UnitOptions


def validate_options(opts: RenderOptions) -> None:
    """UsageError for names systemd would not accept or that would clash with ours."""
    if not opts.exec_path.startswith("/") or any(c.isspace() for c in opts.exec_path):
        raise UsageError(
            f"executable {opts.exec_path!r}: need an absolute path without spaces "
            "(systemd runs ExecStart= without a shell)"
        )
    if not _SLICE_NAME.match(opts.business_slice) or opts.business_slice == INFERENCE_SLICE:
        raise UsageError(
            f"business slice {opts.business_slice!r}: need NAME.slice with letters, digits "
            "or '_' only, not slmguard.slice ('-' would nest it inside another slice)"
        )
    for name in opts.protect:
        if not _SERVICE_NAME.match(name):
            raise UsageError(f"--protect {name!r}: need a service unit name like nginx.service")
        if name in _OWN_UNITS:
            raise UsageError(f"--protect {name!r}: that is one of slmguard's own units")


def check_devices(plan: Plan) -> None:
    """Device nodes and groups go into DeviceAllow=/SupplementaryGroups= verbatim."""
    for node in plan.board.device_nodes:
        if not node.startswith("/dev/") or any(c.isspace() for c in node):
            raise RefusedError(
                f"plan.board.device_nodes: {node!r} is not a path under /dev",
                facts={"device_node": node},
            )
    for group in plan.board.device_groups:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", group):
            raise RefusedError(
                f"plan.board.device_groups: {group!r} is not a group name",
                facts={"device_group": group},
            )


def _mib(n: int) -> str:
    return f"{n / MiB:.0f} MiB"


def check_numbers(
    plan: Plan, *, hugetlb_bytes: int = 0, host_mem_total_bytes: int | None = None
) -> None:
    """Refuse a plan whose numbers cannot hold on this board (see module docstring).

    ``host_mem_total_bytes`` is the target's MemTotal when apply can read it: a
    plan made for a bigger board is refused there, and CommitLimit is computed
    from it as the kernel does (totalram, not the nominal size).
    """
    lim, ram = plan.limits, plan.board.ram_bytes
    if host_mem_total_bytes is not None:
        host_usable = host_mem_total_bytes - lim.os_reserve_bytes
        if lim.memory_max_bytes > host_usable:
            raise RefusedError(
                f"MemoryMax {_mib(lim.memory_max_bytes)} is above this host's MemTotal "
                f"{_mib(host_mem_total_bytes)} minus the OS reserve "
                f"{_mib(lim.os_reserve_bytes)} = {_mib(host_usable)} (the plan is for "
                f"{plan.board.name} with {_mib(ram)})",
                facts={
                    "memory_max_bytes": lim.memory_max_bytes,
                    "host_mem_total_bytes": host_mem_total_bytes,
                    "os_reserve_bytes": lim.os_reserve_bytes,
                    "ram_bytes": ram,
                },
                hint="plan for this board (slmguard plan --board auto)",
            )
    usable = ram - lim.os_reserve_bytes
    if lim.memory_max_bytes > usable:
        raise RefusedError(
            f"MemoryMax {_mib(lim.memory_max_bytes)} is above RAM {_mib(ram)} minus the OS "
            f"reserve {_mib(lim.os_reserve_bytes)} = {_mib(usable)}",
            facts={
                "memory_max_bytes": lim.memory_max_bytes,
                "ram_bytes": ram,
                "os_reserve_bytes": lim.os_reserve_bytes,
            },
            hint="plan again with a smaller context or model",
        )
    mem_min, _ = business_guarantee_bytes(plan)
    total = lim.memory_max_bytes + mem_min + lim.os_reserve_bytes
    if total > ram:
        raise RefusedError(
            f"MemoryMax {_mib(lim.memory_max_bytes)} + business guarantee {_mib(mem_min)} + "
            f"OS reserve {_mib(lim.os_reserve_bytes)} = {_mib(total)} is above RAM {_mib(ram)}",
            facts={
                "memory_max_bytes": lim.memory_max_bytes,
                "business_reserve_bytes": mem_min,
                "os_reserve_bytes": lim.os_reserve_bytes,
                "total_bytes": total,
                "ram_bytes": ram,
            },
            hint="lower the business reserve or the model's limit in the plan",
        )
    k = plan.kernel
    if k.cma_bytes is not None and k.cma_bytes > ram // 2:
        raise RefusedError(
            f"cma= {_mib(k.cma_bytes)} is above half of RAM ({_mib(ram // 2)})",
            facts={"cma_bytes": k.cma_bytes, "ram_bytes": ram},
            hint="the CMA pool is carved out of RAM at boot; keep it to what the NPU needs",
        )
    if k.overcommit_memory == 2:
        base, what = (
            (ram, "RAM") if host_mem_total_bytes is None else (host_mem_total_bytes, "MemTotal")
        )
        commit_limit = (base - hugetlb_bytes) * k.overcommit_ratio // 100
        if k.commit_charge_bytes > commit_limit:
            raise RefusedError(
                f"vm.overcommit_memory=2 with overcommit_ratio={k.overcommit_ratio}: "
                f"CommitLimit ({_mib(base)} {what} - {_mib(hugetlb_bytes)} huge pages) * "
                f"{k.overcommit_ratio}% + 0 swap = {_mib(commit_limit)} would not admit "
                f"the planned commit charge {_mib(k.commit_charge_bytes)}",
                facts={
                    "commit_limit_bytes": commit_limit,
                    "commit_charge_bytes": k.commit_charge_bytes,
                    "ram_bytes": base,
                    "hugetlb_bytes": hugetlb_bytes,
                    "overcommit_ratio": k.overcommit_ratio,
                },
                hint="raise overcommit_ratio or use overcommit_memory=0 in the plan",
            )


def _text(path: str, text: str, why: str) -> RenderedFile:
    return RenderedFile(path, content=text.encode("utf-8"), why=why)


def render_files(plan: Plan, opts: RenderOptions) -> tuple[RenderedFile, ...]:
    """Every file the deployment creates from the plan alone (no edits of host files)."""
    validate_options(opts)
    check_devices(plan)
    check_numbers(plan)
    files = [
        _text(PLAN_PATH, dumps_plan(plan), "the plan the services read"),
        RenderedFile(
            ADMIN_TOKEN_PATH,
            secret_bytes=ADMIN_TOKEN_ENTROPY_BYTES,
            mode=0o600,
            why="admin token of the governor's trim route (apply creates it once)",
        ),
        _text(f"{UNIT_DIR}/{SERVICE}", service_unit(plan, opts), "the model server"),
        _text(f"{UNIT_DIR}/{WATCH_SERVICE}", watch_unit(plan, opts), "the OOM watchdog"),
        _text(f"{UNIT_DIR}/{CRASHDUMP_SERVICE}", crashdump_unit(plan, opts), "OnFailure hook"),
        _text(f"{UNIT_DIR}/{INFERENCE_SLICE}", inference_slice(plan), "inference zone"),
        _text(
            f"{UNIT_DIR}/{opts.business_slice}",
            business_slice(plan, opts),
            "business protection zone",
        ),
    ]
    for name in opts.protect:
        files.append(
            _text(
                f"{UNIT_DIR}/{name}.d/{PROTECT_DROPIN}",
                protect_dropin(plan, opts),
                f"moves {name} into {opts.business_slice}",
            )
        )
    for name in (SERVICE, WATCH_SERVICE):
        files.append(
            RenderedFile(f"{WANTS_DIR}/{name}", link=f"{UNIT_DIR}/{name}", why="enabled at boot")
        )
    files += [
        _text(SYSCTL_PATH, sysctl_conf(plan), "swappiness and overcommit"),
        _text(ZRAM_GENERATOR_PATH, ZRAM_GENERATOR_CONF, "no zram swap from zram-generator"),
    ]
    files += [
        RenderedFile(f"{UNIT_DIR}/{name}", link="/dev/null", why="masked: no zram or swap file")
        for name in SWAP_SERVICES
    ]
    return tuple(files)


def render_fstab(text: str) -> RenderedFile | None:
    """fstab with its swap lines commented out, or None when it has none."""
    new = disable_fstab_swap(text)
    return None if new == text else _text(FSTAB_PATH, new, "swap entries commented out")


def render_boot_file(plan: Plan, boot_path: str, kind: str, text: str) -> RenderedFile | None:
    """The boot file with ``cma=`` set, None when the plan sets no CMA size.

    ``boot_path`` is the destination (absolute, e.g. /boot/armbianEnv.txt).
    Raises RefusedError when the file cannot be parsed or would lose ``root=``.
    """
    cma = plan.kernel.cma_bytes
    if cma is None:
        return None
    try:
        new = bootfiles.set_boot_arg(kind, text, "cma", kernelargs.format_memparse(cma), boot_path)
    except BootFileError as err:
        raise RefusedError(
            f"boot file refused: {err.message}",
            facts={"path": boot_path, "problem": err.problem, "lineno": err.lineno},
            hint=err.hint or "fix the file by hand or remove cma_bytes from the plan",
        ) from err
    return _text(boot_path, new, f"cma={kernelargs.format_memparse(cma)}")
