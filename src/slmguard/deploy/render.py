"""The deployment as files: what ``render`` shows and ``apply`` writes.

Pure: from a :class:`~slmguard.plan.schema.Plan`, :class:`RenderOptions` and
what the target holds (a :class:`~slmguard.deploy.target.TargetState`, read
before by :mod:`slmguard.deploy.target`; empty for ``render`` without
``--root``), :func:`render_deployment` produces :class:`RenderedFile` values
at absolute destination paths, and the notes the user should read. Refusals
happen here, before anything is written, as
:class:`~slmguard.errors.RefusedError` (exit 78): the numbers
(:mod:`slmguard.deploy.checks`), names systemd would not take, a boot file
that cannot be parsed or an edit leaving it without ``root=``.

One file is not rendered: the admin token (``/etc/slmguard/admin-token``) is
a :class:`RenderedFile` with ``secret_bytes`` set and no content. Only
``apply`` makes its random bytes, and only when the file is missing; a token
that is there is kept as it is.

The unit texts are in :mod:`slmguard.deploy.units`, sysctl/swap/zram in
:mod:`slmguard.deploy.system`, boot files in :mod:`slmguard.host.bootfiles`, the
journal's drop-in and ``noatime`` (opt-in board storage settings) in
:mod:`slmguard.deploy.storage`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slmguard.deploy import escape
from slmguard.deploy.checks import check_numbers
from slmguard.deploy.manifest import MANIFEST_DEST
from slmguard.deploy.modelfile import ModelSource, deployed_plan
from slmguard.deploy.storage import JOURNAL_MODES, JOURNALD_DROPIN, add_noatime, journald_conf
from slmguard.deploy.system import (
    FSTAB_PATH,
    SWAP_SERVICES,
    SYSCTL_PATH,
    ZRAM_GENERATOR_CONF,
    ZRAM_GENERATOR_PATH,
    disable_fstab_swap,
    sysctl_conf,
)
from slmguard.deploy.target import TargetState
from slmguard.deploy.units import (
    ADMIN_TOKEN_PATH,
    API_KEY_PATH,
    CRASHDUMP_SERVICE,
    INFERENCE_SLICE,
    PLAN_PATH,
    PROTECT_DROPIN,
    RECOVER_SERVICE,
    SERVICE,
    SYSINIT_WANTS_DIR,
    UNIT_DIR,
    WANTS_DIR,
    WATCH_SERVICE,
    UnitOptions,
    business_slice,
    crashdump_unit,
    inference_slice,
    neighbour_dropin,
    neighbour_units,
    protect_dropin,
    recover_unit,
    service_unit,
    watch_unit,
)
from slmguard.errors import BootFileError, RefusedError, UsageError
from slmguard.host import bootfiles
from slmguard.plan.planfile import dumps_plan, plan_to_dict
from slmguard.plan.schema import Plan

__all__ = [
    "FSTAB_PATH",
    "PLAN_PATH",
    "SYSCTL_PATH",
    "UNIT_DIR",
    "WANTS_DIR",
    "ZRAM_GENERATOR_PATH",
    "Deployment",
    "RenderOptions",
    "RenderedFile",
    "check_devices",
    "check_numbers",
    "render_boot_file",
    "render_deployment",
    "render_files",
    "render_fstab",
    "validate_options",
]

# Unit names: systemd's allowed characters. Slices: no '-', which would nest
# the slice under another one (a-b.slice lives inside a.slice).
_SLICE_NAME = re.compile(r"^[A-Za-z0-9_]+\.slice$")
_OWN_UNITS = {SERVICE, WATCH_SERVICE, CRASHDUMP_SERVICE}
_USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,30}")

#: Random bytes in a generated admin token (``secrets.token_urlsafe``: 43 characters).
ADMIN_TOKEN_ENTROPY_BYTES = 32


@dataclass(frozen=True)
class RenderedFile:
    """One destination path and what should be there: text, a symlink, a secret or the model.

    A secret (``secret_bytes`` set: that many random bytes, URL-safe base64)
    has no content here: apply generates it when the path does not exist and
    never replaces one that does. The model (``model`` set) has no content
    either: apply installs the checked source file there (a hard link or a
    copy, see :mod:`slmguard.deploy.modelfile`).
    """

    path: str  # absolute destination, e.g. /etc/systemd/system/slmguard.service
    content: bytes | None = None
    link: str | None = None  # symlink target (masking: /dev/null)
    mode: int = 0o644
    why: str = ""
    secret_bytes: int | None = None
    model: ModelSource | None = None

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.content, self.link, self.secret_bytes, self.model)]
        if sum(given) != 1:
            raise ValueError(
                f"{self.path}: give exactly one of content, link, secret_bytes and model"
            )

    @property
    def is_secret(self) -> bool:
        return self.secret_bytes is not None

    @property
    def is_model(self) -> bool:
        return self.model is not None

    @property
    def in_review_tree(self) -> bool:
        """Whether ``render --out`` writes it (neither a secret nor the model)."""
        return self.content is not None or self.link is not None


def secret_file_bytes(entropy_bytes: int) -> int:
    """Size of the file apply writes for a secret: the base64url text and a newline."""
    return -(-4 * entropy_bytes // 3) + 1


RenderOptions = UnitOptions


def validate_options(opts: RenderOptions) -> None:
    """UsageError for names systemd would not accept or that would clash with ours."""
    exe = opts.exec_path
    if not exe.startswith("/") or any(c.isspace() or not c.isprintable() for c in exe):
        raise UsageError(
            f"executable {exe!r}: need an absolute path without spaces "
            "(systemd runs ExecStart= without a shell)"
        )
    slice_name = opts.business_slice
    if (
        not escape.is_unit_name(slice_name, ".slice")
        or not _SLICE_NAME.match(slice_name)
        or slice_name == INFERENCE_SLICE
    ):
        raise UsageError(
            f"business slice {slice_name!r}: need NAME.slice with letters, digits "
            "or '_' only, not slmguard.slice ('-' would nest it inside another slice)"
        )
    for name in opts.protect:
        if not escape.is_unit_name(name, ".service"):
            raise UsageError(f"--protect {name!r}: need a service unit name like nginx.service")
        if name in _OWN_UNITS:
            raise UsageError(f"--protect {name!r}: that is one of slmguard's own units")
    if not _USER_NAME.fullmatch(opts.user):
        raise UsageError(f"user {opts.user!r}: not a user name systemd accepts")
    if opts.journal not in JOURNAL_MODES:
        raise UsageError(f"--journal {opts.journal!r}: one of {', '.join(JOURNAL_MODES)}")
    _validate_listener(opts)


def _validate_listener(opts: RenderOptions) -> None:
    """``--listen`` is an IP address and port; a LAN listener names who may connect."""
    try:
        escape.listen_address(opts.host, "--listen")
        escape.bounded_int(opts.port, "--listen port", 1, 65535)
        for i, net in enumerate(opts.allow):
            escape.network(net, f"--allow[{i}]")
    except RefusedError as err:
        raise UsageError(err.message) from err
    if opts.lan and not opts.allow:
        raise UsageError(
            f"--listen {opts.host}: a LAN listener needs --allow NETWORK (the unit lets in "
            "only localhost and those networks)",
            hint="e.g. --listen 0.0.0.0 --allow 10.20.0.0/16",
        )
    if opts.allow and not opts.lan:
        raise UsageError("--allow goes with --listen ADDRESS (a LAN listener)")


def check_devices(plan: Plan) -> None:
    """Device nodes and groups, which go into DeviceAllow=/SupplementaryGroups=, are plain."""
    for i, node in enumerate(plan.board.device_nodes):
        escape.device_node(node, f"plan.board.device_nodes[{i}]")
    for i, group in enumerate(plan.board.device_groups):
        escape.group_name(group, f"plan.board.device_groups[{i}]")


def _plan_json(plan: Plan) -> str:
    """The plan file the services read: JSON (which escapes every string), numbers bounded."""
    escape.json_numbers(plan_to_dict(plan), "plan")
    return dumps_plan(plan)


def _text(path: str, text: str, why: str) -> RenderedFile:
    return RenderedFile(path, content=text.encode("utf-8"), why=why)


def _secrets(opts: RenderOptions) -> list[RenderedFile]:
    """The secrets apply makes on the target: the admin token, and a LAN listener's key."""
    files = [
        RenderedFile(
            ADMIN_TOKEN_PATH,
            secret_bytes=ADMIN_TOKEN_ENTROPY_BYTES,
            mode=0o600,
            why="admin token of the governor's trim route (apply creates it once)",
        )
    ]
    if opts.lan:
        files.append(
            RenderedFile(
                API_KEY_PATH,
                secret_bytes=ADMIN_TOKEN_ENTROPY_BYTES,
                mode=0o600,
                why="API key of the LAN listener (apply creates it once, on the board)",
            )
        )
    return files


def _server_units(plan: Plan, opts: RenderOptions) -> list[RenderedFile]:
    """The server's units, slices and drop-ins, and the links that enable them at boot."""
    files = [
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
    neighbours = neighbour_units(plan)
    for i, n in neighbours:
        assert n.unit is not None
        files.append(
            _text(
                f"{UNIT_DIR}/{n.unit}.d/{PROTECT_DROPIN}",
                neighbour_dropin(plan, opts, i, n),
                f"moves neighbour {n.unit} into {opts.business_slice}, "
                f"Memory{n.protection.capitalize()}= its {n.memory_bytes >> 20} MiB",
            )
        )
    for name in opts.protect:
        if any(n.unit == name for _, n in neighbours):
            continue  # a neighbour's drop-in moves it too, with its protection
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
    return files


def _recovery(opts: RenderOptions) -> list[RenderedFile]:
    """The boot-time recovery of a cut-off apply and its link; first in the deployment, so
    apply writes them before any file a cut could leave half of two plans."""
    unit = f"{UNIT_DIR}/{RECOVER_SERVICE}"
    return [
        _text(unit, recover_unit(opts, MANIFEST_DEST), "undoes an apply a power cut stopped"),
        RenderedFile(f"{SYSINIT_WANTS_DIR}/{RECOVER_SERVICE}", link=unit, why="run at boot"),
    ]


def render_files(plan: Plan, opts: RenderOptions) -> tuple[RenderedFile, ...]:
    """Every file the deployment creates from the plan alone (no edits of host files).

    A Kubernetes node (``opts.kubernetes_node``) gets the plan and the kernel
    side only: no units, slices or secrets (the DaemonSet runs the server).
    """
    validate_options(opts)
    check_devices(plan)
    check_numbers(plan)
    plan_file = _text(PLAN_PATH, _plan_json(plan), "the plan the services read")
    system = [
        _text(SYSCTL_PATH, sysctl_conf(plan), "swappiness and overcommit"),
        _text(ZRAM_GENERATOR_PATH, ZRAM_GENERATOR_CONF, "no zram swap from zram-generator"),
        *(
            RenderedFile(f"{UNIT_DIR}/{name}", link="/dev/null", why="masked: no zram or swap file")
            for name in SWAP_SERVICES
        ),
    ]
    journald = journald_conf(opts.journal)
    if journald is not None:
        system.append(_text(JOURNALD_DROPIN, journald, f"the journal {opts.journal}"))
    if opts.kubernetes_node:
        return (plan_file, *system)
    return (*_recovery(opts), plan_file, *_secrets(opts), *_server_units(plan, opts), *system)


def render_fstab(text: str, *, noatime: bool = False) -> RenderedFile | None:
    """fstab with its swap lines commented out (and ``noatime`` on the state directory's
    mounts when asked), or None when nothing changes."""
    new = disable_fstab_swap(text)
    why = "swap entries commented out"
    if noatime and add_noatime(new) != new:
        new, why = add_noatime(new), why + "; noatime on /, /var, /var/lib"
    return None if new == text else _text(FSTAB_PATH, new, why)


def render_boot_file(plan: Plan, boot_path: str, kind: str, text: str) -> RenderedFile | None:
    """The boot file with ``cma=`` set, None when the plan sets no CMA size.

    ``boot_path`` is the destination (absolute, e.g. /boot/armbianEnv.txt).
    Raises RefusedError when the file cannot be parsed or would lose ``root=``.
    """
    if plan.kernel.cma_bytes is None:
        return None
    cma = escape.memparse_value(plan.kernel.cma_bytes, "plan.kernel.cma_bytes")
    try:
        new = bootfiles.set_boot_arg(kind, text, "cma", cma, boot_path)
    except BootFileError as err:
        raise RefusedError(
            f"boot file refused: {err.message}",
            facts={"path": boot_path, "problem": err.problem, "lineno": err.lineno},
            hint=err.hint or "fix the file by hand or remove cma_bytes from the plan",
        ) from err
    return _text(boot_path, new, f"cma={cma}")


@dataclass(frozen=True)
class Deployment:
    """Every destination's wanted state for one target, and what the user should know."""

    files: tuple[RenderedFile, ...]
    notes: tuple[str, ...] = ()


def _secret_notes(files: tuple[RenderedFile, ...], target: TargetState) -> list[str]:
    """Warnings about secrets that exist (apply keeps them) but will not work or leak."""
    notes = []
    for f in files:
        current = target.secrets.get(f.path)
        if not f.is_secret or current is None or current.kind != "file":
            continue  # a link is kept as the operator made it, and not followed
        if not (current.data or b"").strip():
            notes.append(
                f"{f.path} exists but is empty: the services will refuse it; remove it "
                "and apply again to get a new one"
            )
        mode = current.mode or 0
        if mode & 0o077:
            notes.append(f"{f.path} is readable by others (mode {mode:04o}): chmod 600 {f.path}")
    return notes


def _edits(
    plan: Plan, target: TargetState, opts: RenderOptions
) -> tuple[list[RenderedFile], list[str]]:
    """The edits of the target's own files (fstab, boot file), with their notes."""
    files, notes = [], []
    if target.fstab_text is not None:
        fstab = render_fstab(target.fstab_text, noatime=opts.noatime)
        if fstab is not None:
            files.append(fstab)
            if disable_fstab_swap(target.fstab_text) != target.fstab_text:
                notes.append(
                    "swap entries in /etc/fstab are commented out; swap stays on until "
                    "reboot or `swapoff -a`"
                )
            if opts.noatime and "noatime" in fstab.why:
                notes.append("noatime takes effect at the next mount (reboot, or "
                             "`mount -o remount /`)")  # fmt: skip
    if target.boot is not None:
        boot = render_boot_file(plan, target.boot.dest, target.boot.kind, target.boot.text)
        if boot is not None:
            files.append(boot)
            if boot.content != target.boot.data:
                notes.append(f"{boot.path}: {boot.why} takes effect at the next boot")
    elif target.boot_file_missing:
        notes.append(
            "the plan asks for cma= but no boot file (armbianEnv.txt, uEnv.txt, "
            "extlinux.conf) is under this root: boot arguments left alone"
        )
    return files, notes


def _model_files(
    model: ModelSource | None, others: tuple[ModelSource, ...]
) -> tuple[RenderedFile, ...]:
    """The models to install: the primary's and a board's others, one file per destination
    (two models of one file share it; two files of one name are refused)."""
    files: dict[str, RenderedFile] = {}
    sources = ([model] if model is not None else []) + list(others)
    for i, m in enumerate(sources):
        known = files.get(m.dest)
        if known is not None and known.model is not None and known.model.sha256 != m.sha256:
            raise RefusedError(
                f"two models of the plan install to {m.dest}: {known.model.source} and "
                f"{m.source} (files of the same name)",
                facts={"dest": m.dest},
                hint="rename one of the files and plan the board again",
            )
        what = "the model the server serves" if i == 0 and model is not None else "a board model"
        files.setdefault(m.dest, RenderedFile(m.dest, model=m, why=f"{what}, from {m.source}"))
    return tuple(files.values())


def render_deployment(
    plan: Plan,
    opts: RenderOptions,
    target: TargetState,
    model: ModelSource | None = None,
    others: tuple[ModelSource, ...] = (),
) -> Deployment:
    """The whole deployment of ``plan`` for a target in state ``target``.

    Pure: the target was read before (:func:`slmguard.deploy.target.read_target`)
    and the model checked (:func:`slmguard.deploy.modelfile.planned_model`).
    With ``model``, the deployment installs it and its ``plan.json`` names the
    installed file; without, the plan is written as it is and no model is
    installed (the caller's business). ``others``: a board's other models
    (:func:`slmguard.deploy.modelfile.board_models`), installed the same way.
    Raises RefusedError for anything that must stop render or apply.
    """
    check_numbers(
        plan, hugetlb_bytes=target.hugetlb_bytes, host_mem_total_bytes=target.mem_total_bytes
    )
    files = render_files(deployed_plan(plan, model, others), opts)
    files += _model_files(model, others)
    if model is not None and model.projector is not None:
        v = model.projector
        files += (
            RenderedFile(v.dest, model=v, why=f"the vision projector (--mmproj), from {v.source}"),
        )
    edits, notes = _edits(plan, target, opts)
    files += tuple(edits)
    return Deployment(files, tuple(notes + _secret_notes(files, target) + _neighbour_notes(plan)))


def _neighbour_notes(plan: Plan) -> list[str]:
    """A neighbour moves into the business slice when it next starts (Slice= is read then)."""
    units = [n.unit for _, n in neighbour_units(plan) if n.unit is not None]
    if not units:
        return []
    words = " ".join(escape.shell_word(u) for u in units)
    return [
        f"the neighbours move into their slice, with their protection, when they next start: "
        f"systemctl restart {words}"
    ]
