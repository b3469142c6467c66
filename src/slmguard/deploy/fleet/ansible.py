"""An Ansible role, inventory and playbooks that roll plans out to a fleet of boards, in batches.

Owns ``render --target ansible``. The role (its tasks, defaults, argument
specs and README), the playbooks (``site.yml``, ``rollback.yml``,
``uninstall.yml``), ``rollout.yml`` (the batches and when a rollout stops) and
the settings are fixed files, shipped as package data in ``ansible_tree/``:
read them there, they are the role as Ansible runs it. Only what depends on
the plans and the packages is generated here: the inventory (one group per
board kind), the group vars of every board (``slmguard``: the version and the
package pins) and of each kind (its plan, its model and where the board gets
it, how long it may take to serve, its neighbours' units), and the plans.
Written for ansible-core with ``ansible.builtin`` modules only (no collection
to download) and checked by ``ansible-lint``.

**One source of truth for the bytes.** The role does not carry the rendered
units, sysctl or boot edits: it stages the plan (and the model, unless it is
already on the board) and runs ``slmguard apply`` on the board, which renders
them there with the renderers of :mod:`slmguard.deploy.render`. Three reasons:
the edits of ``/etc/fstab`` and the boot file depend on what the board holds
(only apply reads them, under its root); ``slmguard rollback`` restores only
what apply recorded in its manifest, so files put there by Ansible's ``copy``
could never be rolled back byte for byte; and two copies of the bytes (role
templates and renderers) would drift. The role checks that the board's
slmguard is the version that rendered it, so the bytes are the ones
``render`` shows for that version.

**Plan text is data.** Every string from a plan (board and model names, the
model's path) and from the command line (the mirror, the package files) is
written with Ansible's ``!unsafe`` tag, never templated, through
:mod:`slmguard.deploy.fleet.yamltext`, never syntax.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from slmguard import __version__
from slmguard.deploy.fleet import yamltext
from slmguard.deploy.fleet.kinds import BoardPlan
from slmguard.deploy.fleet.mirror import model_file_name, model_url
from slmguard.deploy.fleet.startup import timing
from slmguard.deploy.fleet.yamltext import Commented, Unsafe
from slmguard.deploy.render import RenderedFile
from slmguard.deploy.units import neighbour_units
from slmguard.errors import UsageError
from slmguard.plan.schema import dumps_plan

if TYPE_CHECKING:  # only a type here; importlib.resources.abc is Python 3.11's
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable  # novermin
    else:
        from importlib.abc import Traversable

#: The role's fixed files (package data), at their paths in the rendered tree.
TREE = "ansible_tree"
#: Files of the fixed tree written as they are; the YAML ones get the header.
VERBATIM = ("ansible.cfg", "roles/slmguard/README.md")
#: ansible-lint allows 160 characters a line; long strings are split below it.
LINE_WIDTH = 150
ROLE = "slmguard"
#: The Debian revision of the package (packaging builds ``slmguard_<version>-1_<arch>.deb``).
DEBIAN_REVISION = "1"
#: A package file as packaging names it: ``slmguard_<version>_<arch>.deb``.
_DEB_NAME = re.compile(r"slmguard_([0-9][A-Za-z0-9.+~-]*)_(amd64|arm64)\.deb")
HEADER = (
    "Rendered by slmguard {version} (render --target ansible). The board runs `slmguard apply`\n"
    "itself: this tree holds the plans, not the rendered files."
)


@dataclass(frozen=True)
class Package:
    """One pinned slmguard Debian package: the file on the controller and its identity."""

    path: Path
    version: str  # the Debian version, e.g. 0.1.0-1
    arch: str
    sha256: str


@dataclass(frozen=True)
class AnsibleOptions:
    """What the tree needs besides the plans.

    Example::

        AnsibleOptions(packages=(package_file(Path("dist/slmguard_0.1.0-1_arm64.deb")),),
                       model_mirror="https://mirror.example/models")
    """

    packages: tuple[Package, ...] = ()
    model_mirror: str | None = None  # a base URL: the board downloads <mirror>/<file name>


def package_file(path: Path) -> Package:
    """A .deb given with ``--package``: named as packaging names it, hashed (UsageError else)."""
    match = _DEB_NAME.fullmatch(path.name)
    if match is None:
        raise UsageError(
            f"--package {path}: not a slmguard package file (slmguard_VERSION_ARCH.deb, "
            "ARCH amd64 or arm64)"
        )
    version, arch = match.groups()
    if version != f"{__version__}-{DEBIAN_REVISION}":
        raise UsageError(
            f"--package {path}: slmguard {version}, but this is slmguard {__version__}: the "
            "board must run the version that renders the role",
            hint=f"give slmguard_{__version__}-{DEBIAN_REVISION}_{arch}.deb",
        )
    digest = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    except OSError as err:
        raise UsageError(f"--package {path}: {err.strerror or err}") from err
    return Package(path.resolve(), version, arch, digest.hexdigest())


def _doc(value: object, what: str = "") -> bytes:
    header = HEADER.format(version=__version__) + (f"\n{what}" if what else "")
    return yamltext.dump(value, header, width=LINE_WIDTH).encode()


def inventory(bps: tuple[BoardPlan, ...]) -> dict[str, object]:
    groups: dict[str, object] = {}
    for bp in bps:
        groups[bp.group] = Commented(
            {"hosts": {}},
            f"Boards of kind {bp.slug}: add each as `name: {{ansible_host: ADDRESS}}`.",
        )
    return {"all": {"children": {"slmguard": {"children": groups}}}}


def fleet_vars(opts: AnsibleOptions) -> dict[str, object]:
    """``group_vars/slmguard.yml``: what every board runs, pinned."""
    version = f"{__version__}-{DEBIAN_REVISION}"
    packages = {
        p.arch: {"file": Unsafe(str(p.path)), "sha256": p.sha256}
        for p in sorted(opts.packages, key=lambda p: p.arch)
    }
    return {
        "slmguard_version": Commented(
            __version__, "The slmguard that rendered this role; every board runs it."
        ),
        "slmguard_package_version": Commented(version, "Its Debian package version."),
        "slmguard_packages": Commented(
            packages,
            "The package by Debian architecture: the .deb on the controller and its sha256, "
            "the pin\n(render --package FILE). None: set slmguard_apt_repository, or "
            "slmguard_install_package: false\nwhere the boards have it already.",
        ),
    }


def group_vars(bp: BoardPlan, opts: AnsibleOptions) -> dict[str, object]:
    """``group_vars/slmguard_<kind>.yml``: the kind's plan, its model and how to get it."""
    t = timing(bp.plan)
    name = model_file_name(bp.model)
    url = "" if opts.model_mirror is None else model_url(opts.model_mirror, bp.model)
    return {
        "slmguard_board": Commented(Unsafe(bp.plan.board.name), "The plan's board name."),
        "slmguard_plan": Commented(
            f"{{{{ playbook_dir }}}}/plans/{bp.slug}.json", "This board kind's plan."
        ),
        "slmguard_model_name": Commented(Unsafe(name), "The model's file name on the board."),
        "slmguard_model_size": bp.model.size_bytes,
        "slmguard_model_sha256": bp.model.sha256,
        "slmguard_model_url": Commented(
            Unsafe(url),
            "The mirror the boards download the model from (checked by sha256; nothing "
            "over SSH).\nEmpty: copied from slmguard_model_src.",
        ),
        "slmguard_model_src": Commented(
            Unsafe(str(bp.model.source)),
            f"The model on the controller: {bp.model.size_bytes} bytes (apply checks it on "
            "the board).",
        ),
        "slmguard_ready_timeout_s": Commented(t.startup_allowance_s, t.why_startup + "."),
        "slmguard_neighbour_units": Commented(
            [Unsafe(n.unit) for _, n in neighbour_units(bp.plan) if n.unit is not None],
            "The plan's neighbours with a unit (issue 39): apply protects each with its "
            "drop-in;\nrestarted when that changes (slmguard_restart_protected), Slice= is "
            "read at start.",
        ),
    }


def _fixed(node: Traversable, rel: str) -> list[tuple[str, bytes]]:
    """(path in the tree, bytes) of every file under ``node``, in name order."""
    out: list[tuple[str, bytes]] = []
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        path = f"{rel}/{child.name}"
        out += _fixed(child, path) if child.is_dir() else [(path, child.read_bytes())]
    return out


def fixed_files() -> tuple[RenderedFile, ...]:
    """The role, the playbooks and the settings: the same bytes for every fleet.

    Shipped as package data (``ansible_tree/``); each YAML file is written
    with the header naming the slmguard that rendered it.
    """
    header = "\n".join(yamltext.comment_text(HEADER.format(version=__version__))) + "\n"
    files = []
    for path, data in _fixed(resources.files(__package__).joinpath(TREE), ""):
        content = data if path.lstrip("/") in VERBATIM else header.encode() + data
        files.append(RenderedFile(path, content=content, why="the role's fixed file"))
    return tuple(files)


def render_tree(
    bps: tuple[BoardPlan, ...], opts: AnsibleOptions = AnsibleOptions()
) -> tuple[RenderedFile, ...]:
    """Every file of ``render --target ansible``, at paths relative to the output directory."""

    def f(path: str, content: bytes, why: str) -> RenderedFile:
        return RenderedFile(path, content=content, why=why)

    files = [
        *fixed_files(),
        f("/inventory/hosts.yml", _doc(inventory(bps)), "one group per board kind"),
        f("/inventory/group_vars/slmguard.yml", _doc(fleet_vars(opts)), "every board: the pins"),
    ]
    for bp in bps:
        files += [
            f(f"/plans/{bp.slug}.json", dumps_plan(bp.plan).encode(), f"plan for {bp.slug}"),
            f(
                f"/inventory/group_vars/{bp.group}.yml",
                _doc(group_vars(bp, opts), f"Board kind {bp.slug}."),
                f"vars of {bp.group}",
            ),
        ]
    return tuple(files)


def packages_for(paths: Sequence[Path]) -> tuple[Package, ...]:
    """The ``--package`` files, at most one per architecture."""
    packages = tuple(package_file(p) for p in paths)
    arches = [p.arch for p in packages]
    for arch in set(arches):
        if arches.count(arch) > 1:
            raise UsageError(f"--package: two packages for {arch}; give one per architecture")
    return packages
